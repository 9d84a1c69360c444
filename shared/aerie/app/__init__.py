"""The aerie app: the `aerie` command line, `aerie run`, `aerie bench` and the operator commands.

The core (`aerie.*` outside this package) never imports it, click or rich: worker images install
the core; the app is for the operator's machine (`pip install aerie[app]`).
"""
