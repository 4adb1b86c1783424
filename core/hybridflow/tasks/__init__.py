"""Synthetic tasks shipped with hybridflow: prompt datasets in verl's column layout plus rule-based rewards."""
