"""The async SDK, written by hand. `sandlot.sdk._sync` is generated from it by
scripts/unasync.py; edit these files and regenerate, never the other way round."""
