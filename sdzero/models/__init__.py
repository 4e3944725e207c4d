"""Model families (SD 1.x/2.x, SDXL, SD3), loading, objectives, EMA, the tiny default and the typed step input."""
