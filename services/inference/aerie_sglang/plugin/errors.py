"""The plugin's refusal, in a module of its own so that every part of the plugin can raise it
without importing the package that loads them (no import cycle)."""


class PluginRefused(RuntimeError):
    """The plugin does not apply to this SGLang; nothing was hooked."""
