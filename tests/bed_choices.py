"""What the shared-GPU bed (tests/test_shared_gpu.py) sets in each worker process before its
tests run: the backend that the automatic choice gets, and a one-node normal-mode variant. Each
holds from then on in that process, for every Buffer its tests make; every rank sets the same."""


def choose_when_automatic(name: str) -> str:
    """From now on in this process, a Buffer whose backend is left to the automatic choice gets
    ``name``; Buffers that name theirs (the torch_dist references) keep it. The shared-GPU bed
    uses it to run the nvlink backend at one node of 8 ranks on one GPU, where the automatic
    choice is nvshmem (ranks sharing a GPU)."""
    import epcomm.buffer as buffer_module
    from epcomm.backends import default_backend_name

    def chosen(group, requested=None, *rest):  # (rest: ranks_per_node, device, what named the backend)
        return default_backend_name(group, requested or name, *rest)

    buffer_module.default_backend_name = chosen
    return name


def use_normal_variant_from_now(variant: str) -> str:
    """From now on in this process, every one-node NormalMode starts in ``variant``: names of
    epcomm.tools.bench.NORMAL_VARIANTS (a comma list), as ``epcomm bench normal --variants`` sets
    them, so that an experiment's kernels meet the same tests as the defaults
    (``EPCOMM_SHARED_GPU_VARIANT``)."""
    from epcomm.backends.gpu.normal.one_node.mode import NormalMode
    from epcomm.tools.bench import normal_variants, use_normal_variants

    names = normal_variants(variant)  # (a misspelt name raises here, before any Buffer)
    made = getattr(NormalMode.__init__, "made", NormalMode.__init__)  # (set twice: the first replaced)

    def made_in_variant(self, *args, **kwargs):
        made(self, *args, **kwargs)
        use_normal_variants(self, names)

    made_in_variant.made = made
    NormalMode.__init__ = made_in_variant
    return variant
