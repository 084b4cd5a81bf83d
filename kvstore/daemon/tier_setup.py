"""The tiers a daemon's config names: checked before any is made, then made, top first.

``check_settings`` names, in one line, what would otherwise fail only later (a CPU tier larger than
the memory available, a codec naming a calibration nobody can find); ``build_tiers`` opens the
tiers the config asks for, top first, from `TIER_KINDS`: the registry of tier kinds, each with the
setting that asks for it and how it is made from the config (`register_tier` adds one; the order of
registration is the order of the tiers, fastest first). What a tier can do, which the store
branches on, its class declares (`tiers.base.Tier`'s attributes). ``kvstore/daemon/process.py``
calls both, in that order, before the store is made.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from compression.calibration_store import CALIBRATION_DIR_ENV
from kvstore.daemon.autocal import AUTO_SPEC
from kvstore.daemon.config import DaemonConfig
from kvstore.host import s3_mac_key
from tiers.at_rest import AtRestKey
from tiers.base import Tier
from tiers.cpu import CpuTier
from tiers.disk import DiskTier
from tiers.gpu import GpuTier
from tiers.s3 import S3Tier


def check_settings(config: DaemonConfig) -> None:
    """ValueError naming the setting, before any tier is made, for what would otherwise fail later:
    a CPU tier larger than the memory this machine (or its cgroup) has available (the arena's
    allocation would say only "Cannot allocate memory", or the prefault would take the machine's
    memory), and a disk or S3 codec naming a kvtc calibration this daemon cannot find (every
    write to that tier would fail, logged per write). Calibrations are looked for where this
    process's kvtc codecs look (``CALIBRATION_DIR_ENV``, set by the daemon from calibration_dir)."""
    if config.cpu_capacity:
        from tiers.cpu import memory_shortfall

        short = memory_shortfall(config.cpu_capacity)
        if short:
            raise ValueError(f"cpu_capacity {short}: lower --cpu-capacity")
    from compression import calibration_store

    for setting, spec, used in ((k.codec_setting, k.codec(config), k.wanted(config))
                                for k in TIER_KINDS.values() if k.codec_setting):
        head = spec.split("+")[0]
        ref = head.partition("@")[2]
        if not used or not ref or spec == AUTO_SPEC:
            continue
        folder = calibration_store.calibration_dir()
        where = f"{folder} (" + ("calibration_dir" if config.calibration_dir else CALIBRATION_DIR_ENV
                                 if os.environ.get(CALIBRATION_DIR_ENV) else
                                 "the default; calibration_dir names another folder") + ")"
        found = sorted(folder.glob(f"{ref}*{calibration_store.SUFFIX}")) if folder.is_dir() else []
        if not found:
            raise ValueError(f"{setting} {spec}: no calibration {ref} in {where}: make one with `kvstore calibrate "
                             f"FILE...` (it prints the codec spec), or copy its <id>{calibration_store.SUFFIX} "
                             f"file there; or use kvtc@auto")
        try:
            calibration_store.resolve(ref)
        except Exception as exc:  # noqa: BLE001 - ambiguous, unreadable, damaged: named in one line
            raise ValueError(f"{setting} {spec}: the calibration in {folder} cannot be used: {exc}") from None


@dataclass(frozen=True)
class TierKind:
    """A kind of tier: ``wanted(config)`` says whether the config asks for it, ``build(config)`` makes
    it (raising TierError, in one line, when its storage cannot be used); ``codec_setting`` names the
    config field holding the codec blocks are re-encoded into when they move down to it ("": they
    keep the codec they were put with)."""
    name: str
    wanted: Callable[[DaemonConfig], bool]
    build: Callable[[DaemonConfig], Tier]
    codec_setting: str = ""

    def codec(self, config: DaemonConfig) -> str:
        """The codec this kind's tier re-encodes into under ``config`` ("raw": as put)."""
        return getattr(config, self.codec_setting) if self.codec_setting else "raw"


#: Tier kinds by name, top (fastest) first.
TIER_KINDS: dict[str, TierKind] = {}


def register_tier(kind: TierKind) -> None:
    """Add a kind of tier below those registered before it; ValueError for a name taken."""
    if kind.name in TIER_KINDS:
        raise ValueError(f"a tier kind named {kind.name!r} is registered already")
    TIER_KINDS[kind.name] = kind


def _s3_tier(config: DaemonConfig) -> Tier:
    mac_key = s3_mac_key(config.tenant_secret_file)  # objects are MAC'd under the hosts' shared secret
    return S3Tier(config.s3_config, mac_key=mac_key,  # TierError saying what to fix when unusable
                  at_rest=AtRestKey.derived("s3", config.tenant_secret_file) if config.s3_encrypt else None)


register_tier(TierKind("gpu", lambda c: bool(c.gpu_capacity), lambda c: GpuTier(c.gpu_capacity, device=c.gpu_device)))
register_tier(TierKind("cpu", lambda c: bool(c.cpu_capacity), lambda c: CpuTier(c.cpu_capacity, pin=c.cpu_pin)))
register_tier(TierKind("disk", lambda c: bool(c.disk_path),
                       lambda c: DiskTier(c.disk_path, c.disk_capacity, fsync=c.disk_fsync, o_direct=c.disk_o_direct,
                                          at_rest=AtRestKey.derived("disk", c.tenant_secret_file)
                                          if c.disk_encrypt else None), "disk_codec"))
register_tier(TierKind("s3", lambda c: bool(c.s3_bucket), _s3_tier, "s3_codec"))


def build_tiers(config: DaemonConfig) -> list[Tier]:
    """The tiers ``config`` asks for, made top first (`TIER_KINDS`)."""
    return [kind.build(config) for kind in TIER_KINDS.values() if kind.wanted(config)]
