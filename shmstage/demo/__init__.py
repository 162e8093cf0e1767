"""``shmstage demo``: the whole flow on a synthetic dataset, measured.

Generates a JPEG dataset on disk, stages it, and trains a tiny CNN twice through
``shmstage run`` (once reading the original, once the staged copy), so a new user
sees what staging and the loader settings do on their own node in about a minute.
As root the original is read through a cgroup read throttle (``--slow-source``), so a
fast local disk stands in for network storage, where staging pays.
"""

from shmstage.demo.pagecache import cached_share, evict_from_page_cache
from shmstage.demo.report import (
    DemoReport,
    DemoRun,
    InspectFacts,
    NodeFacts,
    Payback,
    PillowFacts,
    SlowSource,
    StagingFacts,
    TrainResult,
    busy_note,
    payback,
    suggest_next_steps,
)
from shmstage.demo.run import DEFAULT_BATCH, DEFAULT_IMAGES, DEFAULT_STEPS, WORKDIR_BASE, run_demo
from shmstage.demo.steps import (
    DEFAULT_SLOW_SOURCE_MBPS,
    MB,
    choose_dest,
    prepare_dataset,
    slow_source_throttle,
)

__all__ = [
    "DEFAULT_BATCH",
    "DEFAULT_IMAGES",
    "DEFAULT_SLOW_SOURCE_MBPS",
    "DEFAULT_STEPS",
    "MB",
    "WORKDIR_BASE",
    "DemoReport",
    "DemoRun",
    "InspectFacts",
    "NodeFacts",
    "Payback",
    "PillowFacts",
    "SlowSource",
    "StagingFacts",
    "TrainResult",
    "busy_note",
    "suggest_next_steps",
    "prepare_dataset",
    "cached_share",
    "choose_dest",
    "evict_from_page_cache",
    "payback",
    "run_demo",
    "slow_source_throttle",
]
