"""The trainer's half of every transport: the exporter interface and its factory (``exporter``), CUDA IPC, host shared memory, inline bytes and transfer groups."""
