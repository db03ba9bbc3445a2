"""The persistent block table on the device, brought up to date by each step's few changed entries.

The host's table (gpu/inputs.py) is the source: every step carries the entries written since the step
before (`TableUpdates`), and they are scattered into this copy on the step's stream before its forward. So
a step copies a few entries, not a table (256 seats x 8,192 blocks is 16.8 MB), and async scheduling needs
no table of its own per step: the next step's updates run after this one has read the table, in stream
order, even when they give one of its seats to another sequence.

One row past the seats is all trash block: the seat of a decode graph's padding rows.
"""

from __future__ import annotations

import torch

from gpu.cuda.staging import PinnedStaging
from gpu.inputs import TableUpdates


class DeviceBlockTables:
    def __init__(self, seats: int, max_blocks: int, trash_block: int, device: torch.device) -> None:
        self.max_blocks, self.trash_block, self.device = max_blocks, trash_block, device
        # Entries no sequence has written read the trash block (the cache is zeroed: any block reads finite)
        self.table = torch.full((seats + 1, max_blocks), trash_block, dtype=torch.long, device=device)

    @property
    def padding_seat(self) -> int:
        """The all-trash row."""
        return self.table.shape[0] - 1

    def apply(self, updates: TableUpdates | None, staging: PinnedStaging) -> torch.Tensor:
        """Queue a step's updates (one copy over and one scatter; nothing when none); returns the table."""
        if updates is None:
            raise ValueError("the CUDA step needs its table updates: build inputs with device_tables=True")
        if updates.width != self.max_blocks:
            raise ValueError(f"table updates for rows of {updates.width} blocks, not {self.max_blocks}")
        if updates.seats > self.padding_seat:  # the host's table grew (more live sequences than seats)
            shape = (updates.seats + 1, self.max_blocks)
            with torch.inference_mode(False):  # a plain tensor, as at start, whatever mode the step runs in
                grown = torch.full(shape, self.trash_block, dtype=torch.long, device=self.device)
                grown[: self.padding_seat] = self.table[: self.padding_seat]
            self.table = grown
        count = len(updates.index)
        if count:
            staged = staging.buffer("table_updates", (2, count), torch.long)
            host = staged.numpy()
            host[0], host[1] = updates.index, updates.values
            index, values = staged.to(self.device, non_blocking=True)
            self.table.view(-1).index_copy_(0, index, values)
        return self.table
