"""Normal mode across nodes, two hops (DeepEP's internode shape; a multi-node backend wires it).

    hierarchy.py  the plan, plain Python: nodes, rails, in-node masks, channel prefix matrices
                  (tested on CPU through :mod:`epcomm.testing.two_level`)
    areas.py      what each area of the workspace holds, and the sizes (``bytes_for_tokens``)
    rows.py       what each row holds (count rows, dispatch and combine rows)
    step.py       the barrier every call starts with
    channels.py   what dispatch and combine share: node blocks, channel ranges, the hand-off
    dispatch.py   count exchange and the two-hop dispatch
    combine.py    reduce within the node first, one row per token and node over the network
    mode.py       the host side: plans per call shape and the launches of each call (TwoLevelMode)

The kernels run against the plan on one GPU through the one-GPU test transport (epcomm.testing).
Importing this package loads no kernels.
"""
