"""Checks of aerie's deployment files (scripts/check_deploy.py runs them), one module each."""
