"""Ships ``skip_plugin_verl.pth`` at the top of site-packages: ``site`` runs it when any Python
process of the environment starts (Ray workers too), which arms the verl bridge. The rest of
the metadata is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "skip_plugin_verl.pth"


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        # An editable install takes the top level of its wheel from install_lib, not build_lib.
        top = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.copy_file(PTH, os.path.join(top, PTH))


setup(cmdclass={"build_py": BuildPy})
