"""torch.distributed.checkpoint adapter: save and load DCP checkpoints to and from RAM.

    dcp.save(sd, checkpoint_id=f"{base}/step-{n}", storage_writer=MemoryStorageWriter(base))
    dcp.load(sd, checkpoint_id=f"{base}/step-{n}", storage_reader=MemoryStorageReader(base))
"""

from ml_flashpoint_nemo.dcp.reader import MemoryStorageReader
from ml_flashpoint_nemo.dcp.writer import MemoryStorageWriter

__all__ = ["MemoryStorageReader", "MemoryStorageWriter"]
