"""Compatibility run: the frameworks' own checkpoint tests, stock and with air-plugins substituted.

``python -m compat.run`` (``make compat``); see ``docs/compat.md``. Not part of ``make test``.
"""
