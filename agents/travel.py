"""Hotel and flight specialists of collaborative filtering (RF-010 scenarios 11 to 15, 18):
each scores every option on one criterion, from hotels.json or flights.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents._data import read
from mesh import Agent, AgentContext, Message

Scorer = Callable[[dict[str, Any], dict[str, Any]], float]


def _ceiling(field: str, ceiling: str) -> Scorer:
    return lambda option, scoring: 1 - float(option[field]) / float(scoring[ceiling])


def _ratio(field: str, maximum: str) -> Scorer:
    return lambda option, scoring: float(option[field]) / float(scoring[maximum])


def _mean_ratio(field: str, maximum: str) -> Scorer:
    def score(option: dict[str, Any], scoring: dict[str, Any]) -> float:
        values = [float(v) for v in option[field]]
        return (sum(values) / len(values)) / float(scoring[maximum]) if values else 0.0

    return score


class CriterionAgent(Agent):
    """Scores the options of the city named in the query on one criterion, 0 to 1."""

    def __init__(
        self,
        agent_id: str,
        *,
        data_file: str,
        criterion: str,
        domain: str,
        scorer: Scorer,
        data_dir: str | Path | None = None,
    ) -> None:
        super().__init__(
            agent_id,
            agent_types=(domain, criterion),
            capabilities=(f"score_{criterion}",),
            description=f"Scores {domain} options by {criterion}",
        )
        self.data_file = data_file
        self.criterion = criterion
        self.scorer = scorer
        self.data_dir = data_dir

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        data = await read(self.data_file, self.data_dir)
        content = message.content or {}
        query = str(content.get("query") or message.parameters.get("query") or "")
        cities = data["cities"]
        city = str(
            message.parameters.get("city")
            or next((c for c in cities if c.lower() in query.lower()), next(iter(cities)))
        )
        if city not in cities:
            raise LookupError(f"no {self.data_file.removesuffix('.json')} data for {city}")
        scoring = data["scoring"]
        scores = {
            o["name"]: round(max(0.0, min(1.0, self.scorer(o, scoring))), 4)
            for o in cities[city]["options"]
        }
        best = max(sorted(scores), key=lambda name: scores[name])
        return {
            "scores": scores,
            "recommendation": best,
            "confidence": scores[best],
            "dimension": self.criterion,
            "city": city,
        }


def hotel_agents(data_dir: str | Path | None = None) -> list[Agent]:
    spec = [
        ("PriceAgent", "price", _ceiling("price", "price_ceiling")),
        ("QualityAgent", "quality", _ratio("rating", "rating_max")),
        ("LocationAgent", "location", _ceiling("distance_km", "distance_ceiling_km")),
        ("ReviewsAgent", "reviews", _mean_ratio("review_ratings", "review_max")),
    ]
    return [
        CriterionAgent(
            name,
            data_file="hotels.json",
            criterion=criterion,
            domain="hotel",
            scorer=scorer,
            data_dir=data_dir,
        )
        for name, criterion, scorer in spec
    ]


def flight_agents(data_dir: str | Path | None = None) -> list[Agent]:
    spec = [
        ("FlightPriceAgent", "price", _ceiling("price", "price_ceiling")),
        ("FlightScheduleAgent", "schedule", _ceiling("duration_h", "duration_ceiling_h")),
        ("FlightQualityAgent", "quality", _ratio("airline_rating", "rating_max")),
    ]
    return [
        CriterionAgent(
            name,
            data_file="flights.json",
            criterion=criterion,
            domain="flight",
            scorer=scorer,
            data_dir=data_dir,
        )
        for name, criterion, scorer in spec
    ]
