"""The worker's half of every transport: the importer interface and table (``importer``), CUDA IPC, host shared memory, inline bytes, transfer groups and read-ahead."""
