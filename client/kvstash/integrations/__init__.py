"""Integrations with other frameworks; each module needs its own extra
(`kvstash.integrations.langchain`: `pip install 'kvstash[langchain]'`)."""
