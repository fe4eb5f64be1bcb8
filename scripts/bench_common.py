"""What a benchmark ran on: the CPU model, core count, Python and package versions (shared by the bench scripts)."""

import importlib.metadata
import os
import platform


def machine_info(packages: tuple[str, ...]) -> dict:
    """The CPU's model name, the core count, the Python version and the installed versions of `packages`."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = {}
    for pkg in packages:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "versions": versions}
