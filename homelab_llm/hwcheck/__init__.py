"""Hardware room: GPUs and PCIe links from sysfs (hwcheck), the build wizard's rules and catalog,
and the `plan` command over engine/memory.py."""
