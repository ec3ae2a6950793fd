"""Normal mode (training, prefill) on the GPU layer, in two shapes side by side.

    layout_kernel.py  get_dispatch_layout's kernel and the count arithmetic both shapes share
    one_node/         one hop: every peer of the node by stores (one-node backend); NormalMode
    two_level/        two hops across nodes, DeepEP's internode shape (multi-node backend): a
                      token crosses the network once per node to its rail peer, who forwards it
                      over NVLink; hierarchy.py is the plan, the kernels compute it on the GPU

Importing this package loads no kernels (``two_level.hierarchy`` is plain Python, used on CPU).
"""
