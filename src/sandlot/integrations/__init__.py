"""Providers that plug sandlot into agent and eval frameworks' sandbox interfaces
(docs/integrations.md).

Each lives in its own module and imports its framework there, so importing `sandlot` never
needs one: `sandlot.integrations.inspect_ai` (``pip install "sandlot[inspect]"``),
`sandlot.integrations.langchain` (``"sandlot[langchain]"``) and
`sandlot.integrations.openai_agents` (``"sandlot[openai-agents]"``).
"""
