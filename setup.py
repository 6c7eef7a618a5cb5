"""Packaging: the wheel ships the device sources (csrc/, tasks/, profiler/) inside the package as
megart/_src/, where megart.sources finds them when there is no repository checkout around."""
from pathlib import Path
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

SOURCE_DIRS = ("csrc", "tasks", "profiler")


class BuildPyWithDeviceSources(build_py):
    def run(self):
        super().run()
        here = Path(__file__).resolve().parent
        dest = Path(self.build_lib) / "megart" / "_src"
        for d in SOURCE_DIRS:
            if (here / d).is_dir():
                shutil.copytree(here / d, dest / d, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildPyWithDeviceSources})
