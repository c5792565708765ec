"""An engine's side of engine_tables=True for the tests: the window slot and history pages it
keeps per sequence, and the int32 tensors of a step (kvcc.Runtime.begin_step)."""

from __future__ import annotations

import kvcc
import torch


class EngineTables:
    """What an engine keeps for its sequences: a window slot each (its choice, not the Runtime's)
    and history pages taken from a shuffled free list; block-table columns past a sequence's pages
    hold -1 (never read)."""

    def __init__(self, rt: kvcc.Runtime, slots: list[int], seed: int):
        self.rt = rt
        self.stride = kvcc.pages_for_tokens(rt, rt.max_context)
        self.free = torch.randperm(rt.max_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.slots = slots
        self.lengths = [0] * len(slots)
        self.pages: list[list[int]] = [[] for _ in slots]

    def pages_of(self, i: int) -> torch.Tensor:
        return torch.tensor(self.pages[i] or [-1], dtype=torch.int32, device=self.rt.device)

    def step(self, which: list[int], counts: list[int]) -> tuple[torch.Tensor, ...]:
        """Allocates the pages the new lengths need; the step's (slots, lengths, counts, block_table)."""
        table = torch.full((len(which), self.stride), -1, dtype=torch.int32)
        for j, (i, c) in enumerate(zip(which, counts)):
            need = kvcc.pages_for_tokens(self.rt, self.lengths[i] + c)
            while len(self.pages[i]) < need:
                self.pages[i].append(self.free.pop())
            table[j, :len(self.pages[i])] = torch.tensor(self.pages[i], dtype=torch.int32)

        def ints(xs):
            return torch.tensor(xs, dtype=torch.int32, device=self.rt.device)

        return (ints([self.slots[i] for i in which]), ints([self.lengths[i] for i in which]), ints(counts),
                table.to(self.rt.device))

    def commit(self, which: list[int], counts: list[int]) -> None:
        for i, c in zip(which, counts):
            self.lengths[i] += c
