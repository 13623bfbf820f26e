"""The KV cache's tiers below the device (kv/host_tier.py, kv/disk_tier.py), made from the
engine's settings."""

import os

from cbatch.config import EngineConfig
from cbatch.errors import INVALID_CONFIG, CbatchError
from cbatch.workers.engine.kv.disk_tier import DiskTier
from cbatch.workers.engine.kv.host_tier import HostTier
from cbatch.workers.engine.model_runner import ModelRunner

DEFAULT_CACHE_RAM_MIB = 8192  # as llama-server's --cache-ram
AVAILABLE_MEMORY_SHARE = 4  # by default the tier takes at most a quarter of the memory available at start


def available_memory_bytes() -> int:
    """MemAvailable: what the kernel says can be had without swapping."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cache_ram_bytes(cache_ram_mib: int) -> int:
    if cache_ram_mib >= 0:
        return cache_ram_mib << 20
    return min(DEFAULT_CACHE_RAM_MIB << 20, available_memory_bytes() // AVAILABLE_MEMORY_SHARE)


def make_host_tier(config: EngineConfig, runner: ModelRunner) -> HostTier | None:
    """The host tier (with the disk tier under it when a directory is set), or None when
    off: --cache-ram 0, no prefix cache, no generation context, or the unified pool on a
    model with sliding-window layers (kv/pool.py says why)."""
    if config.cache_ram_mib == 0 or not runner.has_prefix_cache or runner.is_embedding_only:
        return None
    if config.kv_unified and runner.has_swa:
        return None
    disk = None
    if config.cache_dir:
        try:
            disk = DiskTier(config.cache_dir, runner.state_fingerprint(config), int(config.cache_dir_max_gb * 1e9))
        except OSError as err:
            raise CbatchError(INVALID_CONFIG, f"--cache-dir {config.cache_dir}: {err.strerror}") from None
    return HostTier(cache_ram_bytes(config.cache_ram_mib), runner.has_swa, disk)
