"""The sync SDK, generated from `sandlot.sdk._async` by scripts/unasync.py. Do not edit."""
