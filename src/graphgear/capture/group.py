"""What the capture engines of one FX graph share: its memory pool and its capture count
(``capture_config.capture_limit`` counts the live captures of all its keys and threads)."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from .pool import MemoryPool
from .rules import warn

if TYPE_CHECKING:
    from ..config import CaptureConfig
    from ..stats import GraphRecord

__all__ = ["CaptureGroup"]


@dataclasses.dataclass
class CaptureGroup:
    """State shared by the engines of one FX graph (all its keys)."""

    pool: MemoryPool
    custom_pool: MemoryPool | None = None
    captures: int = 0
    limit_warned: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @classmethod
    def for_graph(cls, name: str) -> CaptureGroup:
        return cls(pool=MemoryPool(name=name))

    def pool_for(self, cc: CaptureConfig, name: str) -> MemoryPool:
        """The pool one engine of this graph captures into: the user's
        (``use_custom_pool``), the graph's (``reuse_pool_across_gears``), or its own."""
        custom = cc.use_custom_pool
        if custom is not None:
            if isinstance(custom, MemoryPool):
                return custom
            # a raw device pool handle: the backend turns it into its MemoryPool; one that
            # reaches here (a compiler built without a backend) serves this FX graph
            if self.custom_pool is None:
                self.custom_pool = MemoryPool(pool_id=custom, name=f"custom {custom}")
            return self.custom_pool
        if cc.reuse_pool_across_gears:
            return self.pool
        return MemoryPool(name=f"{name} (private)")

    def take_slot(self, cc: CaptureConfig, record: GraphRecord, stage: str) -> bool:
        """Take one capture slot; False (with a ``stats()`` entry, and one warning per
        graph) when ``capture_limit`` live captures exist already."""
        with self.lock:
            if self.captures < cc.capture_limit:
                self.captures += 1
                return True
            first = not self.limit_warned
            self.limit_warned = True
        reason = f"capture_limit={cc.capture_limit} reached: further graph keys run uncaptured"
        record.add_fallback("capture_limit", reason)
        if first:
            warn(
                f"graphgear: {record.name} ({stage}) reached "
                f"capture_config.capture_limit={cc.capture_limit} live captured graphs; "
                f"new graph keys (sizes, threads, addresses of inputs used in place, parameter "
                f"addresses, or models) run uncaptured from now on. To capture them, raise "
                f"capture_limit, or limit the sizes with graphgear.set_dim_gears(...)."
            )
        return False

    def release(self, graph: Any) -> None:
        """Release one capture (a device graph) and give back its slot."""
        graph.release()
        with self.lock:
            self.captures -= 1

    def reset_count(self) -> None:
        """After every engine released its captures (``graphgear.reset()``)."""
        with self.lock:
            self.captures = max(0, self.captures)
            self.limit_warned = False
