"""Providers that plug sandlot into other frameworks (docs/integrations.md).

Each lives in its own module and imports its framework there, so importing `sandlot` never
needs one: `sandlot.integrations.inspect_ai` (``pip install "sandlot[inspect]"``).
"""
