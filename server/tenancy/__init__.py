"""Tenants: API keys, weights and the admin role (tenants), and what each tenant used (usage)."""
