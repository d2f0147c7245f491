"""The accelerator's vendor module: importing it builds and registers the test device."""

from polytrain_testdev.device import register

register()
