"""The driver's prefix cache calls (strata.gateway.prefix_index says what it keeps).

Before a new generation's first prefill chunk the driver looks up the longest block-aligned prefix of the prompt that
it asked the stages to keep, and asks every stage to restore it into the slot (RestorePrefix); only when every stage
has it does prefill start after it, otherwise the slot is reset and prefilled from position 0, so a lost snapshot
costs time and never changes the output. After a prompt's prefill completes it asks every stage to keep the prompt's
longest chunk-aligned prefix (SavePrefix). Both calls run in the driver between steps, in order with the steps on the
same stages: a snapshot is taken before anything can reset or reuse the slot, and a restore lands before the slot's
first step. They cost one unary call through the stages each, small beside the prefill they save.
"""

from __future__ import annotations

from strata.gateway.generation import Generation
from strata.gateway.prefix_index import PrefixIndex
from strata.gateway.stage_stream import StageStream
from strata.rpc.v1 import stage_pb2


class PrefixCaching(StageStream):
    prefixes: PrefixIndex | None  # None: no prefix cache

    async def _restore_prefixes(self) -> None:
        """Restore the longest known prefix into each new generation's slot, on every stage or not at all."""
        if self.prefixes is None:
            return
        for slot, g in sorted(self._active.items()):
            if g.looked_up or g.cancelled:
                continue
            if len(g.prompt) <= self.prefixes.chunk:
                g.looked_up = True
                continue  # too short to share a whole chunk: never a hit, so not a miss either
            match = self.prefixes.longest(g.prompt, salt=g.cache_salt)
            g.held = match is None and self._prefilled_beside(g)
            if g.held:
                continue
            g.looked_up = True
            if match is None:
                self.metrics.prefix_cache_misses.inc()
                continue
            request = stage_pb2.RestorePrefixRequest(
                fence=self._proto_fence(),
                plan_generation=self.plan_generation,
                slot=slot,
                key=match.key,
                length=match.length,
            )
            reply = await self._unary("RestorePrefix", request)
            self.metrics.observe_prefix_stages(reply.stats)
            if reply.restored:
                g.fed = g.cached = match.length
                g.shares = match.key
                self.metrics.prefix_cache_hits.inc()
                self.metrics.prefix_cache_cached_tokens.inc(match.length)
                continue
            # Some stage lost the snapshot (evicted, restarted): the others restored it, so clear the slot everywhere
            # and prefill it whole.
            self.metrics.prefix_cache_misses.inc()
            self.prefixes.forget(match.key)
            await self._unary("ResetSlot", stage_pb2.ResetSlotRequest(fence=self._proto_fence(), slot=slot))

    def _prefilled_beside(self, g: Generation) -> bool:
        """Whether another generation is prefilling a prompt whose whole chunk-aligned part begins g's prompt (the
        choices of `n > 1`, the same prompt sent twice at once). g then waits for that prefix's snapshot instead of
        computing the same positions beside it, and restores it as soon as the other's prefill lands: it never waits
        longer than its own prefill would have taken."""
        assert self.prefixes is not None
        mine = {d for _, d in self.prefixes.hashes(g.prompt, limit=len(g.prompt), salt=g.cache_salt)}
        for other in self._active.values():
            if other is g or other.held or not other.looked_up or other.cancelled or other.fed >= len(other.prompt):
                continue
            wanted = self.prefixes.to_save(other.prompt, salt=other.cache_salt)
            if wanted is not None and wanted[0] in mine:
                return True
        return False

    async def _save_prefixes(self, chunks: list[stage_pb2.SlotChunk]) -> None:
        """Ask every stage to keep the longest chunk-aligned prefix of each prompt whose prefill just completed."""
        if self.prefixes is None:
            return
        for chunk in chunks:
            g = self._active.get(chunk.slot)
            if g is None or chunk.start_position + chunk.length != len(g.prompt):
                continue
            wanted = self.prefixes.to_save(g.prompt, salt=g.cache_salt)
            if wanted is None:
                continue
            key, length = wanted
            request = stage_pb2.SavePrefixRequest(
                fence=self._proto_fence(), plan_generation=self.plan_generation, slot=chunk.slot, key=key, length=length
            )
            reply = await self._unary("SavePrefix", request)
            self.metrics.observe_prefix_stages(reply.stats)
            if reply.kept:
                self.prefixes.add(g.prompt, key=key, length=length, salt=g.cache_salt)
                g.keeps = key
