"""Anthropic's Messages API on the HTTP door (`/v1/messages`), beside the OpenAI routes."""
