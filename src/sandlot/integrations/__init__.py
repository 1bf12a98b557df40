"""Providers that put sandlot behind agent and eval frameworks' sandbox interfaces.

Each module imports its framework, so importing `sandlot` never does: install the extra
(``pip install "sandlot[langchain]"``, ``"sandlot[openai-agents]"``) and import the module.
"""
