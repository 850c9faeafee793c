// A TypeScript program that uses the client as a TypeScript user would, through the package's
// declarations (lib/mesh.d.ts): `tsc -p test/types` checks it under strict options, and the
// lines marked @ts-expect-error are misuses the declarations must refuse (tsc fails when one
// compiles). Compiled and run against a mesh (AGENTMESH_BROKER, AGENTMESH_GATEWAY), it checks
// at run time that the values are what the declarations say, and prints what it saw as JSON.

import assert from 'node:assert/strict';
import {
  AgentClient, GatewayClient, MeshClient, MeshError, Reject, RetryLater, buildMessage, serveAgent,
  type AgentInfo, type BrokerTotals, type Insight, type JsonObject, type Message,
  type PatternEvent, type PatternStats, type StateChange, type StateEntry, type StatePage,
  type WireMessage,
} from 'agentmesh-client';

/** The misuses the declarations refuse; never called. */
export async function misuses(client: MeshClient, gateway: GatewayClient): Promise<void> {
  // @ts-expect-error: not a priority of the contract
  await client.send('PaymentAgent', { action: 'pay' }, { priority: 'URGENT' });
  // @ts-expect-error: content is a JSON object, not a function
  await client.send('PaymentAgent', { action: () => 'pay' });
  // @ts-expect-error: not a message type
  buildMessage({ to: 'PaymentAgent', type: 'NOTIFY' });
  // @ts-expect-error: a typo in a pattern's request
  await gateway.groupChat({ agentIdz: ['PriceAgent'], query: 'q' });
  // @ts-expect-error: a group chat needs its query
  await gateway.groupChat({ agentIds: ['PriceAgent'] });
  // @ts-expect-error: a parallel run's pattern names its kind
  await gateway.parallel({ patterns: [{ name: 'alone' }] });
  // @ts-expect-error: an RPC the gateway does not have
  await gateway.run('RunAuction', { query: 'q' });
  const info = await client.register();
  // @ts-expect-error: the client reads camelCase, not the wire's snake_case
  console.log(info.agent_id);
  const message = await client.request('PaymentAgent', { action: 'pay' });
  // @ts-expect-error: content may be null
  console.log(message.content.amount);
  // @ts-expect-error: a handler answers with a JSON object
  await serveAgent({ broker: '', agentId: 'A', handler: async () => 42 });
  // @ts-expect-error: a forward names the agent it goes to
  await serveAgent({ broker: '', agentId: 'A', handler: (_m, { forward }) => forward() });
  // (and a handler may return one)
  await serveAgent({ broker: '', agentId: 'A', handler: (_m, { forward }) => forward('B', { n: 1 }) });
  // @ts-expect-error: a lock comes from lockState
  await client.putState('k', 1, { lock: 'token' });
  // @ts-expect-error: RetryLater takes milliseconds, a number
  throw new RetryLater('500ms');
}

async function tour(broker: string, gateway: string): Promise<JsonObject> {
  const seen: JsonObject = {};
  const client = new MeshClient(broker, { agentId: 'TsDesk', retryDelaysMs: [] });
  const caller = new MeshClient(broker, { agentId: 'TsCaller' });
  const agent = await serveAgent({
    broker,
    agentId: 'TsAdder',
    agentTypes: ['ts'],
    actions: ['add'],
    maxInFlight: 4,
    handler: async (message: Message, { attempt }) => {
      const numbers = (message.content?.parameters as JsonObject | undefined)?.numbers;
      if (!Array.isArray(numbers)) throw new Reject('parameters.numbers is required');
      if (numbers.length > 100 && attempt === 1) throw new RetryLater(500, 'a long sum: later');
      return { sum: numbers.reduce<number>((total, n) => total + Number(n), 0) };
    },
  });
  const gatewayClient = new GatewayClient(gateway);
  try {
    const info: AgentInfo = await client.register({ agentTypes: ['ts_desk'] });
    assert.equal(info.agentId, 'TsDesk');
    assert.deepEqual(info.agentTypes, ['ts_desk']);
    assert.match(String(info.registeredAt), /^\d{4}-\d\d-\d\dT/);
    const listed = (await client.listAgents('ts')).map((a: AgentInfo) => a.agentId);
    assert.deepEqual(listed, ['TsAdder']);

    // Priority order, and the message as read.
    const low = await caller.send('TsDesk', { action: 'later' }, { priority: 'LOW' });
    const high = await caller.send('TsDesk', { action: 'now' },
      { priority: 'HIGH', headers: { tenant: 'ts' }, ttl: 60 });
    assert.deepEqual(high.recipients, ['TsDesk']);
    const got: Message[] = await client.receive();
    assert.deepEqual(got.map((m) => m.messageId), [high.messageId, low.messageId]);
    const first = got[0];
    assert.equal(first.type, 'REQUEST');
    assert.equal(first.priority, 'HIGH');
    assert.equal(first.ttl, 60);
    assert.deepEqual(first.headers, { tenant: 'ts' });
    assert.deepEqual(first.content, { action: 'now' });
    assert.equal(first.handoff, null);
    seen.received = got.map((m) => m.content?.action ?? null);

    // A request to the TypeScript-typed Node agent, and its answer.
    const answer = await caller.request('TsAdder', { action: 'add', parameters: { numbers: [1, 2, 3] } });
    assert.equal(answer.type, 'RESPONSE');
    assert.equal(answer.from, 'TsAdder');
    seen.sum = answer.content?.sum ?? null;

    // Refusals are MeshErrors with what the mesh says of them.
    try {
      await client.send('Nobody', { action: 'x' });
      assert.fail('sent to an agent that is not registered');
    } catch (err) {
      assert.ok(err instanceof MeshError);
      seen.unknownAgent = `${err.codeName}`;
    }
    const batch = await client.sendBatch([
      { to: 'TsDesk', content: { action: 'one' } },
      { to: 'TsDesk' },
    ]);
    assert.equal(batch[0].error, undefined);
    assert.equal(batch[1].error?.reason, 'VALIDATION_FAILED');
    seen.batchViolation = batch[1].error?.fieldViolations[0]?.field ?? null;
    await client.receive();

    // A hand-off, read back with its payload.
    const wire: WireMessage = buildMessage({ to: 'TsDesk', content: { action: 'x' } });
    assert.equal(wire.message_type, 'MESSAGE_TYPE_REQUEST');
    await caller.handoff('TsDesk', 'Refund order 12347', {
      context: { order: 12347 }, previousResult: { refundable: true }, workflowId: 'wf-ts',
      stepNumber: 2,
    });
    const [handed] = await client.receive();
    assert.equal(handed.type, 'HANDOFF');
    assert.equal(handed.handoff?.taskDescription, 'Refund order 12347');
    assert.deepEqual(handed.handoff?.context, { order: 12347 });
    assert.equal(handed.handoff?.stepNumber, 2);

    const totals: BrokerTotals = (await client.queueStats()).totals;
    assert.equal(typeof totals.sentCount, 'number');
    assert.ok(totals.handoffCount >= 1);

    // The agent's own server, directly.
    const direct = new AgentClient(agent.address, { agentId: 'TsCaller' });
    try {
      const card = await direct.describe();
      assert.deepEqual(card.actions, ['add']);
      const handled = await direct.handle('TsAdder', { action: 'add', parameters: { numbers: [4] } });
      assert.equal(handled?.content?.sum, 4);
    } finally {
      direct.close();
    }

    // Shared memory and state.
    const insight: Insight = await client.writeInsight({ vote: 'approve' },
      { tags: ['ts_tour'], importance: 0.9, ttlMs: 60000 });
    assert.ok(insight.ttlMs > 0 && insight.expiresAt !== null);
    const read = await client.readInsights({ tags: ['ts_tour'] });
    assert.deepEqual(read.map((i) => i.insightId), [insight.insightId]);
    assert.equal(await client.deleteInsights({ tags: ['ts_tour'] }), 1);
    const entry: StateEntry = await client.putState('ts/tour', { left: 3 }, { expectedVersion: 0 });
    assert.equal(entry.version, 1);
    const lock = await client.lockState('ts/tour', { leaseMs: 5000 });
    await client.putState('ts/tour', { left: 2 }, { lock });
    await client.unlockState(lock);
    seen.state = (await client.getState('ts/tour'))?.value ?? null;
    const page: StatePage = await client.listState('ts/', { pageSize: 10 });
    assert.deepEqual(page.entries.map((e) => e.key), ['ts/tour']);
    assert.equal(page.nextPageToken, '');
    for await (const listed of client.stateEntries('ts/')) assert.equal(listed.version, 2);
    for await (const change of client.watchState('ts/', { sendInitial: true })) {
      const kind: StateChange['kind'] = change.kind;
      assert.equal(kind, 'current');
      assert.equal(change.entry?.key, 'ts/tour');
      break;
    }
    await client.deleteState('ts/tour');
    assert.equal(await client.getState('ts/tour'), null);

    // A gateway pattern from a typed request.
    const kinds: string[] = [];
    const events: PatternEvent[] = await gatewayClient.collaborativeFiltering({
      agentIds: ['PriceAgent', 'QualityAgent', 'LocationAgent', 'ReviewsAgent'],
      weights: { price: 0.2, quality: 0.4, location: 0.3, reviews: 0.1 },
      query: 'Hotel in Paris near Eiffel Tower',
      agentTimeout: '5s',
    }, (event) => { kinds.push(event.kind); });
    const result = events[events.length - 1];
    assert.equal(result.kind, 'RESULT');
    assert.equal(result.pattern, 'COLLABORATIVE_FILTERING');
    assert.deepEqual(events.map((e) => e.kind), kinds);
    seen.filtering = result.data.status ?? null;
    const stats: PatternStats[] = await gatewayClient.patternStats();
    const filtering = stats.find((s) => s.pattern === 'COLLABORATIVE_FILTERING');
    assert.ok(filtering !== undefined && filtering.runs >= 1 && filtering.completionRate > 0);
    return seen;
  } finally {
    await agent.stop();
    await client.deregister().catch(() => undefined);
    gatewayClient.close();
    caller.close();
    client.close();
  }
}

if (require.main === module) {
  const broker = process.env.AGENTMESH_BROKER ?? '127.0.0.1:50051';
  const gateway = process.env.AGENTMESH_GATEWAY ?? '127.0.0.1:50052';
  tour(broker, gateway).then((seen) => {
    console.log(JSON.stringify(seen));
  }, (err: unknown) => {
    console.error(err);
    process.exitCode = 1;
  });
}
