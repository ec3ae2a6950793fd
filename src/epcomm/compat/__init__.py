"""Drop-in shims for code written against other EP libraries."""
