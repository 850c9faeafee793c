"""The stock experts of the group chat (RF-010 scenarios 1 to 5), reasoning over stocks.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agents._data import read
from agents.reasoning import ReasoningAgent
from mesh import Agent, AgentContext, Message


class StockExpert(ReasoningAgent):
    """Base of the experts: answers a query with a recommendation, a confidence and a reason."""

    agent_types = ("stock_expert",)

    async def _rules(self, task: str, inputs: dict[str, Any]) -> dict[str, Any]:
        ticker, confidence, reasoning = self.analyse(inputs["data"])
        return {
            "recommendation": f"Buy {ticker}",
            "confidence": round(confidence, 4),
            "reasoning": reasoning,
            "ticker": ticker,
        }

    async def handle(self, message: Message, ctx: AgentContext) -> dict[str, Any]:
        data = await read("stocks.json", self.data_dir)
        content = message.content or {}
        return await self.reasoner.complete(
            "analyze",
            {
                "query": content.get("query", ""),
                "history": content.get("history", []),
                "expert": self.description or self.agent_id,
                "data": data,
            },
            '{"recommendation": "Buy <TICKER>", "confidence": number 0-1, "reasoning": str, '
            '"ticker": str}',
        )

    def analyse(self, data: dict[str, Any]) -> tuple[str, float, str]:
        raise NotImplementedError


class IndustryExpertAgent(StockExpert):
    """Tech-sector expert: the leader of the strongest sector."""

    agent_id = "IndustryExpertAgent"
    capabilities = ("sector_analysis",)

    def analyse(self, data: dict[str, Any]) -> tuple[str, float, str]:
        sectors = data["sectors"]
        best = max(sectors, key=lambda s: (sectors[s]["strength"], s))
        members = {t: s for t, s in data["stocks"].items() if s["sector"] == best}
        leader = max(members, key=lambda t: (members[t]["market_cap_bn"], t))
        strength = float(sectors[best]["strength"])
        return (
            leader,
            strength,
            (
                f"{leader} strong in {sectors[best]['label']} sector "
                f"(sector strength {strength:.2f})"
            ),
        )


class TechnicalAnalysisAgent(StockExpert):
    """Chart patterns: the strongest trend among stocks with a bullish RSI."""

    agent_id = "TechnicalAnalysisAgent"
    capabilities = ("chart_patterns",)

    def analyse(self, data: dict[str, Any]) -> tuple[str, float, str]:
        band = data["technical"]
        stocks = data["stocks"]
        bullish = {
            t: s
            for t, s in stocks.items()
            if band["rsi_bullish_min"] <= s["rsi"] <= band["rsi_bullish_max"]
        } or stocks
        pick = max(bullish, key=lambda t: (bullish[t]["trend_strength"], t))
        stock = bullish[pick]
        return (
            pick,
            float(stock["trend_strength"]),
            (f"{pick} shows bullish pattern (RSI={stock['rsi']:g})"),
        )


class FundamentalAnalysisAgent(StockExpert):
    """Financials: the lowest P/E among stocks whose earnings grow."""

    agent_id = "FundamentalAnalysisAgent"
    capabilities = ("financials",)

    def analyse(self, data: dict[str, Any]) -> tuple[str, float, str]:
        stocks = data["stocks"]
        growing = {t: s for t, s in stocks.items() if s["earnings_growth"] > 0} or stocks
        pick = min(growing, key=lambda t: (growing[t]["pe"], t))
        pe = float(growing[pick]["pe"])
        confidence = max(0.0, min(1.0, 1 - pe / 100))
        return pick, confidence, f"{pick} P/E ratio attractive (P/E={pe:g})"


def stock_experts(data_dir: str | Path | None = None) -> list[Agent]:
    return [
        IndustryExpertAgent(data_dir=data_dir),
        TechnicalAnalysisAgent(data_dir=data_dir),
        FundamentalAnalysisAgent(data_dir=data_dir),
    ]
