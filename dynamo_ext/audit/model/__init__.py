"""The report model: frozen records merged over ranks, their JSON codec and the generated JSON schema."""
