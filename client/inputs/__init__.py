"""What a trainer hands a push and gets back: tensor specs and bucket layouts (``plan``), reading
DTensors and plain tensors as named items (``dtensor_gather``), and the public result types (``types``).

The bottom layer of the client: it imports nothing else of ``weightwire.client``.
"""
