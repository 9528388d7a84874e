"""What the lifespan handler builds once per process, and every handler uses."""

from __future__ import annotations

from dataclasses import dataclass

from app.core.metrics import Metrics
from app.core.settings import Settings
from app.services.cache import Cache
from app.services.checks import RequestChecks
from app.services.search import SearchService
from app.services.threads import WorkerPools
from app.services.versions import VersionManager
from app.services.workers import WorkerBoard


@dataclass
class AppState:
    settings: Settings
    metrics: Metrics
    cache: Cache
    versions: VersionManager
    pools: WorkerPools
    search: SearchService
    checks: RequestChecks
    workers: WorkerBoard
