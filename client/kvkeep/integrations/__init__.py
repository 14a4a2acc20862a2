"""Integrations with other frameworks; each module needs its own extra
(`kvkeep.integrations.langchain`: `pip install 'kvkeep[langchain]'`)."""
