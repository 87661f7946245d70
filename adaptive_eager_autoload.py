"""``ADAPTIVE_EAGER=1 python train.py``: torch's device-extension autoload calls ``autoload()``.

This module is deliberately top-level and tiny: torch imports it inside ``import torch`` for every
program on a machine where adaptive_eager is installed, so with the flag unset it must cost nothing
(one environment lookup; the adaptive_eager package is not imported).
"""

import os


def autoload() -> None:
    if os.environ.get("ADAPTIVE_EAGER", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    from adaptive_eager.launch import enable_from_env

    enable_from_env()
