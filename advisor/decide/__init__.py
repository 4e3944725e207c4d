"""What chooses: the search, the tie rule, the scaling table, the recommendation and its outcome."""
