"""skip-plugin-verl: skip inside verl's own trainer, and ``skip cache import-verl``.

Installed beside verl, it serves verl's ``verl.utils.skip.SkipManager`` with skip's roles and
verified store (``bridge``), armed at interpreter start-up by ``skip_plugin_verl.pth``
(``startup``); its skip hooks are in ``plugin``. This module stays empty: the start-up hook
imports the package in every Python process of the environment.
"""
