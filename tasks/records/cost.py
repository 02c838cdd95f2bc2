"""Device-hour and money accounting, per stage and in total.

A stage's device hours are its wall-clock hours times the number of devices it held (one CPU "device"
per process on a machine with no GPU). Money is device hours times the configured price per device
hour for the detected device type. Metrics: ``time/<stage>_s``, ``cost/<stage>_device_hours``,
``cost/<stage>_usd`` and the totals ``cost/device_hours``, ``cost/usd``. The run's meter also measures each stage's
peak memory (tasks/records/memory.py).
"""

from __future__ import annotations

import os
import platform
import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from tasks.records.memory import PeakMemory


def detect_device() -> tuple[str, int]:
    """(device type, device count): e.g. ('nvidia-h200', 1) or ('cpu', 1)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).lower()
        m = re.search(r"(h200|h100|a100|l40s|a10g|l4|v100|t4|b200|rtx ?\w+)", name)
        return (f"nvidia-{m.group(1).replace(' ', '')}" if m else "cuda"), torch.cuda.device_count()
    return "cpu", 1


def cpu_model() -> str:
    """The CPU's model name (Linux's ``/proc/cpuinfo``; elsewhere ``platform.processor()``)."""
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", open("/proc/cpuinfo").read(), re.M)
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def describe_machine() -> str:
    """What the figures were measured on, for a benchmark's header: e.g. ``AMD EPYC, 2 cores at 2596 MHz, torch 2
    threads`` (Linux's ``/proc/cpuinfo``; elsewhere ``platform.processor()``), and the GPU when one is visible. The
    same work takes about 2.5x as long on one 2-core machine as on another (README, docs/benchmarks.md)."""
    mhz = None
    try:
        mhz = float(re.search(r"^cpu MHz\s*:\s*([\d.]+)$", open("/proc/cpuinfo").read(), re.M).group(1))
    except (OSError, AttributeError):
        pass
    text = f"{cpu_model()}, {usable_cores()} cores" + (f" at {mhz:.0f} MHz" if mhz else "")
    text += f", torch {torch.get_num_threads()} threads"
    if torch.cuda.is_available():
        text += f"; {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return text


@dataclass
class CostMeter:
    """Accumulates wall time per stage and converts it to device hours and money."""

    prices: dict[str, float]
    device: str | None = None
    devices: int | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: where each stage's peak memory is measured too (tasks/records/memory.py); None: time only
    memory: PeakMemory | None = None

    def __post_init__(self) -> None:
        found, count = detect_device()
        self.device = self.device or found
        self.devices = self.devices or count
        if self.device not in self.prices:
            fallback = "cuda" if self.device.startswith("nvidia") else "cpu"
            self.prices = {**self.prices, self.device: self.prices.get(fallback, 0.0)}

    @contextmanager
    def stage(self, name: str):
        """Time the ``with`` block as stage ``name`` (and measure its peak memory when :attr:`memory` is set)."""
        t0 = time.perf_counter()
        try:
            with self.memory.phase(name) if self.memory is not None else nullcontext():
                yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def wall_seconds(self, name: str | tuple[str, ...] | None = None) -> float:
        """Seconds of one stage, of several (a tuple), or of all (None)."""
        if name is None:
            return sum(self.seconds.values())
        names = (name,) if isinstance(name, str) else name
        return sum(self.seconds.get(n, 0.0) for n in names)

    def device_hours(self, name: str | tuple[str, ...] | None = None) -> float:
        return self.wall_seconds(name) / 3600.0 * (self.devices or 1)

    def usd(self, name: str | tuple[str, ...] | None = None) -> float:
        return self.device_hours(name) * self.prices[self.device]

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, s in self.seconds.items():
            out[f"time/{name}_s"] = s
            out[f"cost/{name}_device_hours"] = self.device_hours(name)
            out[f"cost/{name}_usd"] = self.usd(name)
        out["cost/device_hours"] = self.device_hours()
        out["cost/usd"] = self.usd()
        return out

    def state_dict(self) -> dict:
        return {"seconds": dict(self.seconds)}

    def load_state_dict(self, state: dict) -> None:
        self.seconds = dict(state["seconds"])
