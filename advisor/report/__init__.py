"""The self-contained HTML reports: page model, figures, the advise and training pages."""
