"""SGLang adapter (see README "Use with SGLang")."""
