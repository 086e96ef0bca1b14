"""The decode loop of a generation batch (``batchgen.py`` lays the batch out): its rows
decode together, each leaving at its own end, and rows may join between steps.

Each step is four moves on one :class:`Decoding`: a forward pass over the rows still
going (:meth:`Decoding._forward`), each row's token chosen as ``inference.generate``
chooses it alone (:meth:`Decoding._choose`), the rows that are done dropped with their KV
rows (:meth:`Decoding._drop_done`), and rows waiting to join prefilled and merged in
(:meth:`Decoding._admit`). A row leaves the batch as soon as it has its
``max_new_tokens`` or its end-of-sequence token, so a step costs only the rows still
going (Hugging Face ``generate`` would run every row to the longest one's length).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import SoftTimeLimitExceeded

from sits_queue.cache import kvwarm
from sits_queue.workers import decoding, firsttoken, kvreuse, runtime

if TYPE_CHECKING:
    from sits_queue.workers.batchgen import _Row
    from sits_queue.workers.batchjoin import Joining


def takes_positions(module: Any) -> bool:
    """Whether the model's forward takes positions; models that do not (ALiBi) place
    tokens by the attention mask alone."""
    return "position_ids" in inspect.signature(module.forward).parameters


def positions_of(mask: Any) -> Any:
    """Each position's place among its row's real tokens (padding, masked out, counts
    none): what a row alone would have there."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


class Decoding:
    """One batch's decode, from its layout (its first ``cached`` positions already in
    ``past``) to each row's new tokens (:meth:`run`).

    Positions count each row's real tokens (its padding is masked out), and each row's
    token is chosen as :func:`inference.generate` chooses it alone: greedy, or sampled with
    the row's seed at that position. ``leave(row, tokens)`` is told of each row that leaves
    before the last ones.

    Continuous batching: between steps, ``joining`` may give rows to join the batch
    (``rows``, the caller's list, grows): prefilled together (``batchjoin.prefill_rows``),
    their KV rows merged into the batch's (``kvreuse.merge_rows``); they leave like the
    others. Leading positions no row attends to any more are dropped
    (``kvreuse.trim_padding``). ``first``: a lone row prefilled that way already, its first
    token the layout's last.
    """

    def __init__(self, module: Any, model: str, rows: list[_Row], input_ids: Any, mask: Any,
                 past: Any, cached: int, eos: frozenset[int],
                 active: runtime.ActiveTask | None, leave: Callable[[int, list[int]], None],
                 joining: Joining | None = None, first: int | None = None) -> None:
        import torch

        self.module, self.model, self.rows, self.eos = module, model, rows, eos
        self.active, self.leave, self.joining = active, leave, joining
        self.device = next(module.parameters()).device
        self.kwarg = kvwarm.cache_kwarg(module)
        self.by_position = takes_positions(module)
        self.past = past
        self.mask = mask.to(self.device)
        self.positions = positions_of(self.mask)[:, cached:]
        self.ids = input_ids[:, cached:].to(self.device)
        self.generator = torch.Generator(device="cpu")
        self.new: list[list[int]] = [[] for _ in rows]
        if first is not None:
            self.new[0].append(first)
        self.live = list(range(len(rows)))  # the rows still decoding, in batch order
        self.steps, self.longest = 0, max(row.most for row in rows)
        #: Whether the batch's cache can take rows and be trimmed (its kind does not
        #: change while it decodes): known from the first step's cache.
        self.plain: bool | None = None
        self.began = time.monotonic()

    def run(self) -> list[list[int]]:
        """Each row's new tokens, the joined rows' after the batch's own."""
        import torch

        try:
            with torch.inference_mode():
                while True:
                    if self.active is not None:
                        self.active.check_time(self.steps, self.longest)
                    tokens = self._drop_done(self._choose(self._forward()))
                    if tokens is None:
                        return self.new
                    self.positions = self.positions[:, -1:]
                    tokens += self._admit()
                    self._advance(tokens)
        except SoftTimeLimitExceeded:
            raise SoftTimeLimitExceeded(
                f"soft time limit hit while generating a batch of {len(self.rows)} with "
                f"model {self.model!r}: stopped after {self.steps} of {self.longest} decode "
                "steps") from None
        finally:
            # A traceback keeps this object alive: drop the KV cache now, not with it.
            self.past = None

    def _forward(self) -> Any:
        """One step's forward pass over the live rows: the last position's logits."""
        extra = {"position_ids": self.positions} if self.by_position else {}
        out = self.module(input_ids=self.ids, attention_mask=self.mask, use_cache=True,
                          **{self.kwarg: self.past}, **extra)
        try:
            self.past = kvwarm.cache_of(out)
            if self.plain is None:
                self.plain = kvreuse.reusable(self.past)
            return out.logits[:, -1, :].float()  # (an out-of-memory error here too)
        finally:
            del out  # it holds the KV cache: not to be kept alive by a traceback

    def _choose(self, logits: Any) -> list[int]:
        """Each live row's token, appended to its tokens; in the live rows' order."""
        import torch

        try:
            tokens: list[int] = torch.argmax(logits, dim=-1).tolist()  # waits for the step
            firsttoken.mark()
            self.steps += 1
            for b, r in enumerate(self.live):
                row = self.rows[r]
                if row.temperature > 0:
                    tokens[b] = decoding.sampled(logits[b:b + 1], row.temperature,
                                                  row.seed, len(self.new[r]), self.generator)
                self.new[r].append(tokens[b])
            return tokens
        finally:
            del logits  # not kept alive by a traceback

    def _drop_done(self, tokens: list[int]) -> list[int] | None:
        """The rows done at this step leave, their KV rows dropped; the tokens of the rows
        still going, or None when none is."""
        import torch

        going = [b for b, r in enumerate(self.live)
                 if len(self.new[r]) < self.rows[r].most and self.new[r][-1] not in self.eos]
        if not going:
            return None
        if len(going) < len(self.live):
            for b in sorted(set(range(len(self.live))) - set(going)):
                self.leave(self.live[b], self.new[self.live[b]])
            keep = torch.tensor(going, device=self.device)
            self.past.batch_select_indices(keep)
            self.mask, self.positions = self.mask[keep], self.positions[keep]
            self.live = [self.live[b] for b in going]
        return [tokens[b] for b in going]

    def _admit(self) -> list[int]:
        """Rows waiting to join, prefilled and merged into the batch (those the device
        cannot take now are declined: they run after it); the first tokens of those that
        go on decoding, in the order they join the live rows."""
        import torch

        joining = self.joining
        if joining is None or not self.plain:
            return []
        fresh = joining.take(len(self.live), (time.monotonic() - self.began) / self.steps)
        if not fresh:
            return []
        prefilled = joining.prefill(fresh, self.generator)
        if prefilled is None:
            for row in fresh:
                joining.decline(row)
            return []
        cache, rows_mask, firsts, starts = prefilled
        kept, tokens = [], []
        for b, row in enumerate(fresh):
            joining.starts[row.index] = starts[b]
            joining.first(row.index)
            self.rows.append(row)
            self.new.append([firsts[b]])
            if row.most <= 1 or firsts[b] in self.eos:  # done at its first token
                self.leave(len(self.rows) - 1, self.new[-1])
                continue
            kept.append(b)
            self.live.append(len(self.rows) - 1)
            tokens.append(firsts[b])
            self.longest = max(self.longest, self.steps + row.most)
        if kept:
            if len(kept) < len(fresh):
                cache.batch_select_indices(torch.tensor(kept, device=self.device))
                rows_mask = rows_mask[kept]
            self.positions = torch.cat([self.positions, rows_mask.sum(-1, keepdim=True) - 1])
            self.past, self.mask = kvreuse.merge_rows(self.past, self.mask, cache, rows_mask)
        return tokens

    def _advance(self, tokens: list[int]) -> None:
        """The next step's input: each live row's last token, one position on."""
        import torch

        if self.plain:
            self.mask = kvreuse.trim_padding(self.past, self.mask)
        self.ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        self.positions = self.positions + 1
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(self.live), 1))], dim=1)
