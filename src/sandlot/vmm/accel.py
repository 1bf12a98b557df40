"""Choose the QEMU accelerator: KVM on hosts with real VMX/SVM, TCG otherwise (PVM hosts too)."""

from __future__ import annotations

import os
from pathlib import Path


def detect_accel() -> str:
    """`kvm` or `tcg`, as this host can run (config.Settings.accelerator: unless set)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    if Path("/sys/module/kvm_pvm").exists():
        return "tcg"  # PVM cannot run a normal guest kernel
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "tcg"
    if " vmx" in flags or " svm" in flags:
        return "kvm"
    return "tcg"


def accel_args(accel: str, cpu_model: str = "") -> list[str]:
    """The accelerator and CPU model arguments (`cpu_model` "": the accelerator's default,
    vmm/cpu.py)."""
    if accel == "kvm":
        return ["-accel", "kvm", "-cpu", cpu_model or "host"]
    return ["-accel", "tcg,thread=multi,tb-size=64", "-cpu", cpu_model or "max"]
