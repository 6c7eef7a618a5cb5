"""Packaging. The device tree (csrc/, tasks/, profiler/) is mapped into the package, so a wheel holds
megart/tasks/<name>.py next to megart/tasks/<name>.cuh exactly as a checkout holds tasks/<name>.py next to
tasks/<name>.cuh; megart/sources.py finds the tree by that one rule."""
from setuptools import find_packages, setup

DEVICE_TREE = {"megart.tasks": "tasks", "megart.csrc": "csrc", "megart.profiler": "profiler"}

DATA_ONLY = ("megart.faithful.candidates",)   # the faithful gate's planted candidate bodies

setup(
    packages=find_packages(include=["megart", "megart.*"]) + list(DATA_ONLY) + list(DEVICE_TREE),
    package_dir=DEVICE_TREE,
    package_data={pkg: ["*.cuh"] for pkg in (*DATA_ONLY, *DEVICE_TREE)},
)
