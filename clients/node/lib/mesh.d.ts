// Type declarations of the Node.js client and agent (lib/mesh.js), for TypeScript users and
// editors. Field names are those the client reads and writes (camelCase); the wire names are
// the proto's (proto/mesh/v1/*.proto). test/types/ holds a strict TypeScript program that uses
// all of it, and test/declarations.test.js keeps these names level with what lib/mesh.js exports.

/// <reference types="node" />
import type { EventEmitter } from 'node:events';
import type * as grpc from '@grpc/grpc-js';

// -- values -------------------------------------------------------------------------------------

/** Any JSON value (what a google.protobuf.Value holds). */
export type JsonValue = null | boolean | number | string | JsonValue[] | JsonObject;
/** A JSON object (what a google.protobuf.Struct holds). */
export interface JsonObject {
  [key: string]: JsonValue;
}

/** The message types of the envelope (RT-011). */
export type MessageType = 'REQUEST' | 'RESPONSE' | 'BROADCAST' | 'HANDOFF' | 'ERROR' | 'ACK';
/** Delivery order: HIGH, then MEDIUM, then LOW; oldest first within one. */
export type Priority = 'HIGH' | 'MEDIUM' | 'LOW';
/** A gRPC status code by name (grpc.status), e.g. 'RESOURCE_EXHAUSTED'. */
export type StatusName = keyof typeof grpc.status;
/** Milliseconds, a string such as '2s', '1.5s' or '500ms', or a google.protobuf.Duration. */
export type Duration = number | string | { seconds: number; nanos?: number };

// -- messages -----------------------------------------------------------------------------------

/** What a HANDOFF message carries (RT-011 hand-off protocol), read out of its content. */
export interface Handoff {
  taskDescription: string;
  /** Everything gathered so far, handed over complete. */
  context: JsonObject;
  previousResult: JsonValue;
  constraints: JsonObject;
  workflowId: string;
  stepNumber: number;
}

/** A message as the client reads it (readMessage). */
export interface Message {
  messageId: string;
  from: string;
  to: string;
  type: MessageType;
  /** null when the message carries none. */
  content: JsonObject | null;
  /** ISO 8601. */
  timestamp: string | null;
  metadata: JsonObject;
  correlationId: string;
  priority: Priority;
  /** Seconds; 0 is the broker's default. */
  ttl: number;
  replyTo: string;
  ackRequired: boolean;
  headers: Record<string, string>;
  /** ISO 8601: a scheduled message, not delivered before then; null when sent at once. */
  deliverAt: string | null;
  /** A HANDOFF's payload; null for every other type. */
  handoff: Handoff | null;
}

/** The options of a message besides its recipient and content. */
export interface MessageOptions {
  /** A fresh UUID by default. The broker takes a message id once. */
  messageId?: string;
  /** REQUEST by default. */
  type?: MessageType;
  /** MEDIUM by default. */
  priority?: Priority;
  /** Seconds; 0 takes the broker's default. */
  ttl?: number;
  metadata?: JsonObject;
  correlationId?: string;
  replyTo?: string;
  /** The sender gets an ACK message from the recipient as the broker first hands it over
   * (RF-009's acknowledgement of receipt). */
  ackRequired?: boolean;
  headers?: Record<string, string>;
  /** Not delivered before this time (by the broker's clock): a scheduled message. */
  deliverAt?: Date | string;
  /** Not delivered before this many milliseconds from now (deliverAt, worked out here). */
  delayMs?: number;
}

/** A message to build (buildMessage). */
export interface MessageFields extends MessageOptions {
  from?: string;
  to?: string;
  content?: JsonObject;
}

/** A message in the proto's form (mesh.v1.Message), as buildMessage makes it. */
export interface WireMessage {
  message_id: string;
  from_agent: string | undefined;
  to_agent: string | undefined;
  message_type: string;
  content: object | undefined;
  timestamp: { seconds: number; nanos: number };
  metadata: object;
  correlation_id: string;
  priority: string;
  ttl: number;
  reply_to: string;
  ack_required: boolean;
  headers: Record<string, string>;
  deliver_at?: { seconds: number; nanos: number };
}

/** A message as the broker accepted it: with its id and the agents it was queued for. */
export interface SentMessage extends Message {
  recipients: string[];
}

// -- errors -------------------------------------------------------------------------------------

export interface FieldViolation {
  field: string;
  description: string;
}

/** What MeshError is built from: a grpc-js ServiceError, or an error an answer carried. */
export interface MeshErrorSource {
  code: number;
  details?: string;
  message?: string;
  metadata?: grpc.Metadata;
  reason?: string;
  fieldViolations?: FieldViolation[];
  retryAfterMs?: number | null;
}

/**
 * Every refusal: the gRPC status code and what the mesh's rich status says of it.
 */
export class MeshError extends Error {
  constructor(source: MeshErrorSource);
  /** The gRPC status code. */
  code: number;
  /** The code's name, e.g. 'NOT_FOUND'. */
  codeName: StatusName | undefined;
  /** The machine-readable reason: QUEUE_FULL, VALIDATION_FAILED, TOOL_NOT_ALLOWED, ... */
  reason: string;
  /** The fields that failed validation. */
  fieldViolations: FieldViolation[];
  /** Under backpressure, how long to wait before trying again. */
  retryAfterMs: number | null;
}

/**
 * Thrown by a handler for a message it can never process: the message goes to the
 * dead-letter queue at once, with this reason, instead of being redelivered.
 */
export class Reject extends Error {
  constructor(reason: string);
}

/**
 * Thrown by a handler for a message it cannot handle yet (a rate limit met, a resource not
 * ready): the message goes back to the broker and comes again afterMs from now (more than 0,
 * at most a day; a RangeError otherwise), to whichever instance of the agent is free then,
 * its place in flight taking the agent's other messages meanwhile. A requester waits on
 * (within its own timeout); nothing is answered now. The delivery counts as an attempt. Called
 * directly, the agent answers UNAVAILABLE, reason RETRY_LATER, with the wait in a RetryInfo.
 */
export class RetryLater extends Error {
  constructor(afterMs: number, reason?: string);
  readonly afterMs: number;
}

// -- security -----------------------------------------------------------------------------------

/** TLS and token options; each falls back on its AGENTMESH_* environment variable. */
export interface SecurityOptions {
  /** AGENTMESH_TLS_CA: a CA bundle's path; turns TLS on. */
  tlsCa?: string;
  /** AGENTMESH_TLS_CLIENT_CERT: the client certificate's path, for mutual TLS. */
  tlsClientCert?: string;
  /** AGENTMESH_TLS_CLIENT_KEY: its key's path. */
  tlsClientKey?: string;
  /** AGENTMESH_TOKEN: sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /**
   * AGENTMESH_TOKEN_FILE: a file holding the token (in place of token), looked at again every
   * second: a rotated token is sent from then on.
   */
  tokenFile?: string;
  /** AGENTMESH_TLS_SERVER_NAME: the name the server's certificate is checked against. */
  tlsServerName?: string;
}

export interface Security {
  credentials: grpc.ChannelCredentials;
  metadata: grpc.Metadata;
  channelOptions: grpc.ChannelOptions;
  /** Stops looking at the token file (a no-op without one). */
  stop(): void;
}

// -- the broker client --------------------------------------------------------------------------

/** One retry of a call refused for a moment (onRetry). */
export interface RetryEvent {
  /** 1 for the first retry. */
  attempt: number;
  code: StatusName;
  delayMs: number;
  error: MeshError;
}

export interface MeshClientOptions extends SecurityOptions {
  /** The agent this client speaks as. */
  agentId?: string;
  /**
   * The waits before each retry (RT-011: [100, 500, 2000]); [] for none. A refusal that asks
   * for a longer wait (its google.rpc.RetryInfo, `MeshError.retryAfterMs`) gets it, up to a
   * minute.
   */
  retryDelaysMs?: number[];
  onRetry?: (retry: RetryEvent) => void;
}

export interface AgentInfo {
  agentId: string;
  agentTypes: string[];
  /** The agent's own server, for direct calls (AgentClient); '' when it has none. */
  address: string;
  capabilities: string[];
  /** ISO 8601. */
  registeredAt: string | null;
  /** The addresses of every process serving the agent (sharing its queue), the latest last. */
  instances: string[];
  /** ISO 8601: when its last instance died, while none serves it since; null otherwise. */
  lostAt: string | null;
  /** The latest registration's: PUSH, the broker calls HandleMessage on its instance's server;
   * PULL, the instance takes them. Each instance keeps its own: pushInstances. */
  deliveryMode: DeliveryMode;
  /** PUSH: the broker's calls in flight to one instance at most (0: the broker's default). */
  maxInFlight: number;
  /** The instances the broker pushes to (registered with PUSH); the others pull. */
  pushInstances: string[];
  /** Content keys every REQUEST and HANDOFF sent to the agent must carry (the latest
   * registration's). */
  requiredFields: string[];
}

export type DeliveryMode = 'PULL' | 'PUSH';

export interface Registration {
  agentId?: string;
  agentTypes?: string[];
  address?: string;
  capabilities?: string[];
  /** 'PUSH' needs address: the broker calls HandleMessage there. Default 'PULL'. */
  deliveryMode?: DeliveryMode;
  /** PUSH: the broker's calls in flight to one instance at most (0, the default: its own). */
  maxInFlight?: number;
  /** Content keys every REQUEST and HANDOFF sent to the agent must carry, e.g.
   * ['action', 'parameters']: the broker refuses one that lacks any (INVALID_ARGUMENT, a field
   * violation per key). At most 32. */
  requiredFields?: string[];
}

export interface HandoffOptions {
  context?: JsonObject;
  previousResult?: JsonValue;
  constraints?: JsonObject;
  workflowId?: string;
  /** 1 by default. */
  stepNumber?: number;
  priority?: Priority;
  ttl?: number;
  headers?: Record<string, string>;
  /** The handing agent; the client's agentId by default. */
  from?: string;
}

export interface RequestOptions extends MessageOptions {
  /** How long to wait for the correlated RESPONSE, retries included (10,000 by default). */
  timeoutMs?: number;
  /** Gives the request up when it aborts (rejecting with its reason). */
  signal?: AbortSignal;
}

/** A message of a batch: as for send, with its recipient. */
export interface BatchMessage extends MessageOptions {
  to: string;
  content?: JsonObject;
}

/** One message of a batch: accepted (no error) or refused on its own. */
export interface BatchResult {
  messageId: string;
  error?: MeshError;
}

export interface AgentQueueStats {
  agentId: string;
  depth: number;
  high: number;
  medium: number;
  low: number;
  inFlight: number;
  deadLetters: number;
  subscribers: number;
  /** Held until a time: scheduled (deliverAt), or nacked with a delay. */
  deferred: number;
}

/** The broker-wide counters (mesh.v1.BrokerTotals). */
export interface BrokerTotals {
  held: number;
  maxMessagesPerAgent: number;
  maxTotalMessages: number;
  sentCount: number;
  deliveredCount: number;
  expiredCount: number;
  droppedCount: number;
  validationErrors: number;
  deadLetteredCount: number;
  redeliveredCount: number;
  handoffCount: number;
  broadcastCount: number;
  sendLatencyP50Ms: number;
  sendLatencyP95Ms: number;
  sendLatencyP99Ms: number;
  roundtripLatencyP50Ms: number;
  roundtripLatencyP95Ms: number;
  roundtripLatencyP99Ms: number;
  receiveLatencyP50Ms: number;
  receiveLatencyP95Ms: number;
  receiveLatencyP99Ms: number;
  handoffLatencyP50Ms: number;
  handoffLatencyP95Ms: number;
  handoffLatencyP99Ms: number;
  broadcastLatencyP50Ms: number;
  broadcastLatencyP95Ms: number;
  broadcastLatencyP99Ms: number;
  /** Messages dropped per message offered, 0 to 1. */
  dropRate: number;
  /** Requests withdrawn because their requester gave up. */
  withdrawnCount: number;
}

export interface QueueStats {
  agents: AgentQueueStats[];
  totals: BrokerTotals;
}

export interface DeadLetter {
  message: Message;
  reason: string;
  attempts: number;
  /** ISO 8601. */
  deadLetteredAt: string | null;
}

/** A message its agent's queue holds (MeshClient.listMessages). */
export interface QueuedMessage {
  message: Message;
  /** Waiting for delivery, delivered and not acknowledged yet, or nacked for later. */
  state: 'WAITING' | 'IN_FLIGHT' | 'DEFERRED';
  /** How many times it was delivered (the one in flight included); 0: never. */
  attempts: number;
  /** ISO 8601. */
  acceptedAt: string | null;
  /** ISO 8601: when its ttl ends. */
  expiresAt: string | null;
  /** ISO 8601: when its lease (in flight) or its delay (deferred) ends; null while waiting. */
  until: string | null;
}

export interface Tool {
  name: string;
  description: string;
}

export interface GatherOptions extends MessageOptions {
  /** The agents asked; with agentTypes, the agents of those types too; neither: every agent. */
  agentIds?: string[];
  agentTypes?: string[];
  /** 5,000 by default. */
  timeoutMs?: number;
  /** Nobody is asked when one of agentIds is not registered. */
  allOrNone?: boolean;
  /** Gives the gather up when it aborts (rejecting with its reason). */
  signal?: AbortSignal;
}

/** One agent's outcome of a gather: its answer, or why there is none. */
export interface GatherOutcome {
  agentId: string;
  response: Message | null;
  error: { code: number; reason: string; message: string } | null;
}

export type Decision = 'accept' | 'reject' | 'counter';

/** A peer's answer in a round of a negotiation. */
export interface NegotiationReply {
  peer: string;
  decision: Decision;
  proposal?: JsonObject | null;
  reason: string;
}

export interface NegotiationRound {
  round: number;
  proposal: JsonObject;
  replies: NegotiationReply[];
  /** Peers that did not answer in time. */
  missing: string[];
}

export interface NegotiationOptions {
  topic?: string;
  /** 1 to 3 (3 by default). */
  rounds?: number;
  /** At most 5,000 (the default). */
  timeoutMs?: number;
  /** The next round's terms from this round's and the counters (default: the counters win). */
  revise?: (terms: JsonObject, counters: NegotiationReply[]) => JsonObject;
}

export interface Negotiation {
  status: 'AGREED' | 'REJECTED' | 'NO_AGREEMENT' | 'TIMED_OUT';
  proposal: JsonObject;
  rounds: NegotiationRound[];
  negotiationId: string;
}

/** An insight of the shared memory pool. */
export interface Insight {
  insightId: string;
  agentId: string;
  content: JsonValue;
  tags: string[];
  importance: number;
  segment: string;
  metadata: JsonObject;
  /** ISO 8601. */
  createdAt: string | null;
  /** 0 when it is kept until deleted. */
  ttlMs: number;
  expiresAt: string | null;
}

export interface InsightOptions {
  tags?: string[];
  /** 0 to 1 (0.5 by default). */
  importance?: number;
  segment?: string;
  metadata?: JsonObject;
  agentId?: string;
  /** Kept this long; 0 (the default) until deleted. */
  ttlMs?: number;
}

export interface InsightQuery {
  tags?: string[];
  segment?: string;
  minImportance?: number;
  limit?: number;
  agentId?: string;
}

export interface InsightFilter {
  insightIds?: string[];
  tags?: string[];
  segment?: string;
  agentId?: string;
}

export interface MemoryStats {
  totalInsights: number;
  /** How many agents wrote the insights held. */
  agentsInvolved: number;
  tagDistribution: Record<string, number>;
  segmentDistribution: Record<string, number>;
  capacity: number;
}

/** A versioned entry of the shared state. */
export interface StateEntry {
  key: string;
  value: JsonValue;
  version: number;
  updatedBy: string;
  /** ISO 8601. */
  updatedAt: string | null;
  /** When the entry lapses (ISO 8601); null when it stays until deleted. */
  expiresAt: string | null;
}

/** One page of a listing of the shared state. */
export interface StatePage {
  /** In key order. */
  entries: StateEntry[];
  /** Pass it as pageToken for the next page; '' when this page is the last. */
  nextPageToken: string;
}

/** A change to an entry of the shared state, as a watch tells it. */
export interface StateChange {
  /** current: as the watch began; synced: the watch is in place (entry null); put: written;
   * delete: deleted; lapse: its ttl ran out. */
  kind: 'current' | 'synced' | 'put' | 'delete' | 'lapse';
  /** The new version (put), the last (delete, lapse), as it is (current); null for synced. */
  entry: StateEntry | null;
}

export interface StateListOptions {
  /** At most this many entries (100 by default, 1000 at most). */
  pageSize?: number;
  /** The previous page's nextPageToken; '' (default): the first page. */
  pageToken?: string;
}

export interface StateLock {
  key: string;
  token: string;
  /** ISO 8601. */
  expiresAt: string | null;
}

export interface StateWriteOptions {
  /** A compare-and-set: ABORTED (VERSION_CONFLICT) when another write came first; 0: none yet. */
  expectedVersion?: number;
  /** The writer's lock, when it holds one. */
  lock?: StateLock;
  /** putState only: the entry lapses this many milliseconds after the write. */
  ttlMs?: number;
  agentId?: string;
}

export interface BroadcastOptions extends MessageOptions {
  /** Only agents of these types; every other registered agent when empty. */
  agentTypes?: string[];
}

export interface BroadcastResult {
  messageId: string;
  recipients: string[];
  /** Agents that could not take a copy (a full queue). */
  failures: { agentId: string; error: MeshError }[];
}

/**
 * What a handler is given beside the message: signal aborts (with a MeshError CANCELLED,
 * reason WITHDRAWN) when the broker withdraws the delivery because its requester gave up
 * (cancelled, or past its deadline), or, on an agent's own server, when the caller cancels.
 */
export interface HandlerContext {
  signal: AbortSignal;
  /**
   * How many deliveries the broker makes in all: after the one whose attempt this is, a
   * failure goes to the dead-letter queue (0 when the broker does not say, and on a direct
   * call to the agent's own server, which is not a delivery; the broker's push says it).
   */
  maxDeliveryAttempts: number;
  /**
   * Which delivery of the message this is: 1 the first, more after a failure or a
   * RetryLater (1 on a direct call to the agent's own server).
   */
  attempt: number;
}

/**
 * What a session's handler resolves to: the answer (a message built with buildMessage; it
 * takes the place of the ack when it answers the delivery) or null (acknowledged). Once
 * context.signal aborted, its outcome is neither sent nor acknowledged.
 */
export type SessionHandler = (message: Message, attempt: number, context: HandlerContext)
=> Promise<WireMessage | null | undefined> | WireMessage | null | undefined;

export interface SessionOptions {
  agentId?: string;
  /** Deliveries outstanding at most (16). */
  maxInFlight?: number;
  /** Deliveries in one frame at most (16). */
  maxBatch?: number;
  /** How long an ack waits for company in a steady flow (2). */
  ackLingerMs?: number;
  /** How long a delivery stays leased unless acked (30,000); extended while handled. */
  leaseMs?: number;
  /** How long a handler may keep its delivery leased by extending it (3,600,000). */
  maxLeaseExtensionMs?: number;
  /**
   * The address this agent's process registered: the session holds that instance among the
   * agent's, and its loss (the process dies) takes it off. '' (default): none.
   */
  instance?: string;
}

/** An agent's deliveries on a Connect stream (session()). */
export interface AgentSession extends EventEmitter {
  /**
   * Ends the session gracefully: what is being handled is answered for up to graceMs (5,000),
   * then the subscription ends and what came meanwhile goes back as never delivered.
   */
  close(graceMs?: number): Promise<void>;
  /** Ends it at once; the broker hands back what was not acknowledged. */
  cancel(): void;
  /** The broker took the subscription. */
  on(event: 'subscribed', listener: () => void): this;
  /** The broker refused an answer it was sent. */
  on(event: 'refused', listener: (error: MeshError) => void): this;
  /** The broker withdrew these deliveries: their requester gave up. */
  on(event: 'withdrawn', listener: (messageIds: string[]) => void): this;
  /**
   * The session is over: a MeshError of reason AGENT_DEREGISTERED (NOT_FOUND) when the broker
   * ended the subscription because the agent was deregistered.
   */
  on(event: 'error', listener: (error: Error) => void): this;
  on(event: 'end', listener: () => void): this;
  on(event: string | symbol, listener: (...args: any[]) => void): this;
  once(event: 'subscribed', listener: () => void): this;
  once(event: 'refused', listener: (error: MeshError) => void): this;
  once(event: 'error', listener: (error: Error) => void): this;
  once(event: 'end', listener: () => void): this;
  once(event: string | symbol, listener: (...args: any[]) => void): this;
}

/** An agent's deliveries on the plain Subscribe stream (subscribe()). */
export interface Subscription extends EventEmitter {
  cancel(): void;
  /** The broker withdrew these deliveries: their requester gave up. */
  on(event: 'withdrawn', listener: (messageIds: string[]) => void): this;
  on(event: 'error', listener: (error: Error) => void): this;
  on(event: 'end', listener: () => void): this;
  on(event: string | symbol, listener: (...args: any[]) => void): this;
}

/** A client of the broker, speaking as one agent. */
export class MeshClient {
  constructor(address: string, options?: MeshClientOptions);
  agentId: string;
  retryDelaysMs: number[];
  onRetry: ((retry: RetryEvent) => void) | undefined;
  /** Retries by the code that caused them. */
  readonly stats: { retries: Partial<Record<StatusName, number>> };

  close(): void;
  /** A string alone is the agent id. */
  register(registration?: Registration | string): Promise<AgentInfo>;
  deregister(agentId?: string, options?: { address?: string }): Promise<void>;
  /** Every registered agent (of agentType, when given), by id: all the broker's pages. */
  listAgents(agentType?: string): Promise<AgentInfo[]>;

  /** Sends a message; resolves with it as accepted. */
  send(to: string, content: JsonObject | undefined, options?: MessageOptions & { from?: string }):
  Promise<SentMessage>;
  /** Hands a task to another agent with everything gathered so far. */
  handoff(to: string, taskDescription: string, options?: HandoffOptions): Promise<Message>;
  /** Removes and returns the agent's queued messages (HIGH first, then oldest first): up to
   * maxMessages (0: all) and 3 MiB an answer, the rest waiting for the next call. */
  receive(agentId?: string, maxMessages?: number): Promise<Message[]>;
  /** Sends a REQUEST and waits for the correlated RESPONSE (or ERROR). */
  request(to: string, content: JsonObject | undefined,
    options?: RequestOptions & { from?: string }): Promise<Message>;
  sendBatch(messages: BatchMessage[], options?: { timeoutMs?: number }): Promise<BatchResult[]>;
  queueStats(agentId?: string): Promise<QueueStats>;

  /** Runs a tool as this agent, under its allow-list; resolves with the tool's result. */
  callTool(tool: string, args?: JsonObject, options?: { timeoutMs?: number; agentId?: string }):
  Promise<JsonValue>;
  listTools(agentId?: string): Promise<Tool[]>;
  /** The dead-letter queue (of agentId, when given), oldest first: all the broker's pages. */
  deadLetters(agentId?: string): Promise<DeadLetter[]>;
  /**
   * What the agent's queue holds (this client's agent by default), left there: the messages
   * waiting in delivery order, then those in flight or deferred; all the broker's pages.
   */
  listMessages(agentId?: string): Promise<QueuedMessage[]>;
  /** Takes back messages sent to `to` not delivered yet (waiting or scheduled): the ids
   * taken back. */
  cancelMessages(to: string, messages: Array<string | Message>, options?: { from?: string }):
  Promise<string[]>;
  /** Puts dead letters back in the agent's queue (all, or those named). */
  requeueDeadLetters(agentId: string, messageIds?: string[]):
  Promise<{ requeued: number; left: number }>;

  gather(content: JsonObject, options?: GatherOptions): Promise<GatherOutcome[]>;
  negotiate(peers: string[], proposal: JsonObject, options?: NegotiationOptions):
  Promise<Negotiation>;

  writeInsight(content: JsonValue, options?: InsightOptions): Promise<Insight>;
  readInsights(query?: InsightQuery): Promise<Insight[]>;
  /** Resolves with how many were removed. */
  deleteInsights(filter: InsightFilter): Promise<number>;
  memoryStats(): Promise<MemoryStats>;

  /** null when there is no such key. */
  getState(key: string): Promise<StateEntry | null>;
  /** A page of the entries whose keys start with prefix ('' for all), in key order. */
  listState(prefix?: string, options?: StateListOptions): Promise<StatePage>;
  /** Every entry whose key starts with prefix, in key order, a page read at a time. */
  stateEntries(prefix?: string): AsyncIterable<StateEntry>;
  /** Each change under prefix as it is made, until the loop is left. */
  watchState(prefix?: string,
    options?: { sendInitial?: boolean; resume?: boolean; reconnectTimeoutMs?: number }):
  AsyncGenerator<StateChange>;
  endWorkflow(workflowId: string, options?: { status?: 'COMPLETED' | 'FAILED';
    failedAtStep?: number; errorReason?: string; agentId?: string }): Promise<StateEntry | null>;
  putState(key: string, value: JsonValue, options?: StateWriteOptions): Promise<StateEntry>;
  deleteState(key: string, options?: StateWriteOptions): Promise<StateEntry>;
  lockState(key: string, options?: { waitMs?: number; leaseMs?: number; agentId?: string }):
  Promise<StateLock>;
  unlockState(lock: StateLock): Promise<void>;

  broadcast(content: JsonObject, options?: BroadcastOptions): Promise<BroadcastResult>;
  session(handle: SessionHandler, options?: SessionOptions): AgentSession;
  subscribe(onDelivery: (message: Message, attempt: number, context: HandlerContext)
  => Promise<unknown> | unknown,
    options?: { agentId?: string; maxInFlight?: number; leaseMs?: number;
      maxLeaseExtensionMs?: number; instance?: string }): Subscription;
}

// -- the gateway client -------------------------------------------------------------------------

export type PatternName = 'UNSPECIFIED' | 'GROUP_CHAT' | 'HAND_OFF' | 'COLLABORATIVE_FILTERING'
| 'PARALLEL' | 'CONSENSUS' | 'RESEARCH';

export type EventKind = 'UNSPECIFIED' | 'GROUP_CREATED' | 'BROADCAST_SENT' | 'CONTRIBUTION'
| 'AGENT_MISSING' | 'WORKFLOW_CREATED' | 'HANDOFF' | 'STEP_RESULT' | 'PATTERN_SWITCH' | 'SCORES'
| 'AGGREGATION' | 'ROUTED' | 'RESULT' | 'FAILURE' | 'PROPOSAL' | 'VOTE' | 'DECISION' | 'PLAN'
| 'FINDINGS' | 'CONFLICT' | 'ESCALATION' | 'ITERATION' | 'REPORT';

/** One event of a pattern's run, as the gateway streams it; the RESULT comes last. */
export interface PatternEvent {
  runId: string;
  pattern: PatternName;
  kind: EventKind;
  /** ISO 8601. */
  timestamp: string | null;
  elapsedMs: number;
  agentId: string;
  step: number;
  round: number;
  summary: string;
  data: JsonObject;
}

export interface GroupChatRequest {
  agentIds: string[];
  query: string;
  rounds?: number;
  strategy?: string;
  optionLabel?: string;
  agentTimeout?: Duration;
  groupId?: string;
  context?: JsonObject;
  hierarchy?: Record<string, number>;
  expertise?: Record<string, number>;
}

export interface WorkflowStep {
  agentId?: string;
  taskDescription?: string;
  /** An outcome of the step's result -> the agent of the next step. */
  routes?: Record<string, string>;
  groupChat?: GroupChatRequest;
  parallelAgentIds?: string[];
}

export interface HandoffWorkflowRequest {
  steps: WorkflowStep[];
  task: string;
  context?: JsonObject;
  constraints?: JsonObject;
  failureAgent?: string;
  maxHops?: number;
  stepTimeout?: Duration;
  workflowId?: string;
}

export interface CollaborativeFilteringRequest {
  agentIds: string[];
  weights?: Record<string, number>;
  query: string;
  method?: string;
  seed?: number;
  agentTimeout?: Duration;
  parameters?: JsonObject;
}

export interface RouteRequest {
  requestType: string;
  query?: string;
  parameters?: JsonObject;
}

/** One pattern of a parallel run: exactly one of groupChat, handOff, collaborativeFiltering, route. */
export type PatternSpec = { name: string } & (
  | { groupChat: GroupChatRequest }
  | { handOff: HandoffWorkflowRequest }
  | { collaborativeFiltering: CollaborativeFilteringRequest }
  | { route: RouteRequest });

export interface ParallelRequest {
  patterns: PatternSpec[];
}

export interface ConsensusRequest {
  problem: string;
  reviewerIds?: string[];
  proposerId?: string;
  facilitatorId?: string;
  threshold?: number;
  quorum?: number;
  reviewerWeights?: Record<string, number>;
  waitForAllVotes?: boolean;
  agentTimeout?: Duration;
  insightTtl?: Duration;
}

export interface ResearchRequest {
  query: string;
  documents?: boolean;
  maxIterations?: number;
  subagentTimeout?: Duration;
  toolTimeout?: Duration;
  dependencies?: Record<string, { dependsOn: string[] }>;
  failOnCycle?: boolean;
  constraints?: JsonObject;
  reportName?: string;
}

/** The streaming RPCs of mesh.v1.GatewayService and the request each takes. */
export interface GatewayRequests {
  RunGroupChat: GroupChatRequest;
  RunHandoffWorkflow: HandoffWorkflowRequest;
  RunCollaborativeFiltering: CollaborativeFilteringRequest;
  Route: RouteRequest;
  RunParallel: ParallelRequest;
  RunConsensus: ConsensusRequest;
  RunResearch: ResearchRequest;
}

/** A pattern's request, plus how long the whole run may take (60,000 ms by default). */
export type RunRequest<R> = R & { timeoutMs?: number };
export type OnEvent = (event: PatternEvent) => void;

/** One pattern's figures since the gateway started. */
export interface PatternStats {
  pattern: PatternName;
  runs: number;
  completed: number;
  partial: number;
  failed: number;
  durationAvgSeconds: number;
  completionRate: number;
  consensusRate: number;
  rated: number;
  satisfied: number;
  accuracy: number;
}

/** A client of the gateway: every multi-agent pattern as a stream of events. */
export interface GatewayClientOptions extends SecurityOptions {
  /**
   * The waits before each start again of a run the gateway refused before it started
   * (RESOURCE_EXHAUSTED, reason TOO_MANY_RUNS; RT-011: [100, 500, 2000]), and before each
   * retry of patternStats and recordFeedback while refused for now (RESOURCE_EXHAUSTED,
   * UNAVAILABLE); [] for none. A refusal that asks for a longer wait (its
   * google.rpc.RetryInfo) gets it, up to a minute.
   */
  retryDelaysMs?: number[];
  onRetry?: (retry: RetryEvent) => void;
}

export class GatewayClient {
  constructor(address: string, options?: GatewayClientOptions);
  retryDelaysMs: number[];
  onRetry: ((retry: RetryEvent) => void) | undefined;
  close(): void;
  /** Runs a pattern RPC; resolves with every event streamed, the RESULT last. */
  run<M extends keyof GatewayRequests>(method: M, request: RunRequest<GatewayRequests[M]>,
    onEvent?: OnEvent): Promise<PatternEvent[]>;
  groupChat(request: RunRequest<GroupChatRequest>, onEvent?: OnEvent): Promise<PatternEvent[]>;
  handoffWorkflow(request: RunRequest<HandoffWorkflowRequest>, onEvent?: OnEvent):
  Promise<PatternEvent[]>;
  collaborativeFiltering(request: RunRequest<CollaborativeFilteringRequest>, onEvent?: OnEvent):
  Promise<PatternEvent[]>;
  route(request: RunRequest<RouteRequest>, onEvent?: OnEvent): Promise<PatternEvent[]>;
  parallel(request: RunRequest<ParallelRequest>, onEvent?: OnEvent): Promise<PatternEvent[]>;
  consensus(request: RunRequest<ConsensusRequest>, onEvent?: OnEvent): Promise<PatternEvent[]>;
  research(request: RunRequest<ResearchRequest>, onEvent?: OnEvent): Promise<PatternEvent[]>;
  patternStats(options?: { timeoutMs?: number }): Promise<PatternStats[]>;
  /** Whether a finished run (by its events' runId) satisfied the user. */
  recordFeedback(runId: string, satisfied: boolean, options?: { timeoutMs?: number }):
  Promise<{ pattern: PatternName; stats: PatternStats }>;
}

// -- an agent's own server ----------------------------------------------------------------------

export interface AgentCard {
  agentId: string;
  agentTypes: string[];
  capabilities: string[];
  tools: Tool[];
  description: string;
  actions: string[];
}

/** A client of one agent's own server (RT-011 peer-to-peer), at the address it registered. */
export class AgentClient {
  constructor(address: string, options?: SecurityOptions & { agentId?: string });
  agentId: string;
  close(): void;
  describe(options?: { timeoutMs?: number }): Promise<AgentCard>;
  /** The agent's answer (RESPONSE or ERROR), or null when it had nothing to say. */
  handle(to: string, content: JsonObject | undefined, options?: RequestOptions):
  Promise<Message | null>;
}

// -- a Node.js agent ----------------------------------------------------------------------------

/** A REQUEST handed on to another agent, as a serveAgent handler returns it. */
export interface Forward {
  readonly to: string;
  readonly content?: JsonObject;
}

export interface AgentHandlerContext extends HandlerContext {
  /**
   * Hands the REQUEST on instead of answering it (`return forward('BillingAgent')`): the next
   * agent answers the requester in this agent's place, under the request's correlation id,
   * with `content` (the request's by default); the forward expires with the request and is
   * withdrawn with it. A TypeError for any other type of message.
   */
  forward(agentId: string, content?: JsonObject): Forward;
  /** The agent's own client (its messages come from the agent): for the handler's requests. */
  client: MeshClient;
}

/** TLS for an agent's own server; each falls back on its AGENTMESH_* environment variable. */
export interface ServerSecurityOptions {
  /**
   * AGENTMESH_TLS_CERT: the server certificate's path (with tlsKey, TLS; with tlsCa as well,
   * mutual TLS: callers must present a certificate the CA signed). Renewed files are used
   * from the next connection on.
   */
  tlsCert?: string;
  /** AGENTMESH_TLS_KEY: its key's path. */
  tlsKey?: string;
  /** AGENTMESH_TLS_CA: the CA that signs the callers' certificates. */
  tlsCa?: string;
  /**
   * AGENTMESH_TLS_CLIENT_AUTH: 'require' (the default) asks callers for a certificate the CA
   * signed; 'none' asks for none (the CA is then the agent's client's alone).
   */
  tlsClientAuth?: 'require' | 'none';
  /**
   * AGENTMESH_CREDENTIALS_FILE: the credentials file (the broker's format) the agent's server
   * holds its callers to: a bearer token it names, and a message sent only as an agent the
   * caller may act as. Read again when it changes.
   */
  credentialsFile?: string;
}

export interface AgentOptions extends SecurityOptions, ServerSecurityOptions {
  /** The broker's address. */
  broker: string;
  agentId: string;
  agentTypes?: string[];
  capabilities?: string[];
  /** Content keys every REQUEST and HANDOFF sent to the agent must carry (see Registration). */
  requiredFields?: string[];
  /**
   * The response's content (its action is the request's unless it names one), or null/undefined
   * for none; a throw answers a request with an ERROR and hands anything else back after
   * RT-011's backoff, 100 ms, 500 ms, then 2 s, the fourth failure to the dead-letter queue (a
   * Reject: to the dead-letter queue at once).
   */
  handler: (message: Message, context: AgentHandlerContext)
  => Promise<JsonObject | Forward | null | undefined> | JsonObject | Forward | null | undefined;
  description?: string;
  actions?: string[];
  host?: string;
  /** 0 (the default): any free port. */
  port?: number;
  /** An answer the broker refused (a warning on the console by default). */
  onRefused?: (error: MeshError) => void;
  /** How long a delivery stays leased unless acked (30,000); extended while handled. */
  leaseMs?: number;
  /** How long a handler may keep its delivery leased by extending it (3,600,000). */
  maxLeaseExtensionMs?: number;
  /**
   * How many of its messages the agent handles at once (16): deliveries outstanding on its
   * session, or the broker's calls at once to its server when it takes them by push.
   */
  maxInFlight?: number;
  /**
   * 'PULL' (the default): the agent takes its messages on a session; 'PUSH': the broker calls
   * its server's HandleMessage with each one (the server must be reachable from the broker).
   */
  deliveryMode?: DeliveryMode;
  /**
   * AGENTMESH_AGENT_HEALTH_PORT: a plaintext server of grpc.health.v1 alone (the same
   * statuses) beside a TLS one, for probes that cannot speak TLS; 0 any free port, -1 (the
   * default) none.
   */
  healthPort?: number;
  /**
   * AGENTMESH_WAIT_FOR_BROKER (in seconds there): how long to wait for a broker that cannot be
   * reached yet as the agent starts, its server up and not ready meanwhile; 0 (the default):
   * the start fails once the client's retries are spent.
   */
  waitForBrokerMs?: number;
  retryDelaysMs?: number[];
  onRetry?: (retry: RetryEvent) => void;
}

export interface ServedAgent {
  /** host:port of its own server. */
  address: string;
  /** host:port of its plaintext health server (healthPort), or null. */
  healthAddress: string | null;
  /** NOT_SERVING, then what it is handling is answered within graceMs (5,000), then gone. */
  stop(graceMs?: number): Promise<void>;
}

/**
 * Serves an agent: its own gRPC server, registered with the broker, taking deliveries.
 * Resolves once it takes its messages (its health for mesh.v1.AgentService says SERVING then,
 * and NOT_SERVING while it has lost the broker), or after 10 s, still trying. Its health for
 * agentmesh.agents, the process's readiness, says SERVING while every agent the process serves
 * takes its messages. Deregistered
 * (agentmesh deregister), a pulling agent takes no more messages and stays NOT_SERVING: it
 * does not register itself again.
 */
export function serveAgent(options: AgentOptions): Promise<ServedAgent>;

// -- helpers ------------------------------------------------------------------------------------

/**
 * A mesh.v1.Message from its fields; a type or priority the contract lacks is a TypeError, and
 * so is content JSON cannot carry (NaN or Infinity, a BigInt, a function, a Map or a Set,
 * nesting past 25 levels, or circular).
 */
export function buildMessage(fields: MessageFields): WireMessage;
/** A message as the client reads it, from a mesh.v1.Message. */
export function readMessage(pb: object): Message;
/** A google.protobuf.Struct from a JSON object. */
export function toStruct(obj: JsonObject | null | undefined): { fields: Record<string, object> };
/** A JSON object from a google.protobuf.Struct. */
export function fromStruct(struct: { fields?: Record<string, object> } | null | undefined):
JsonObject;
/**
 * A request of the named type (e.g. 'mesh.v1.RunGroupChatRequest') from a plain object of its
 * fields (snake_case or camelCase); a field it lacks is a TypeError.
 */
export function toRequest(typeName: string, obj: Record<string, unknown>): Record<string, unknown>;
export function toDuration(value: Duration): { seconds: number; nanos: number };
/** Channel credentials, call metadata and channel options from options and AGENTMESH_*. */
export function security(options?: SecurityOptions): Security;
/** Credentials for an agent's own server from options and AGENTMESH_*: plaintext, TLS, or
 * mutual TLS (see ServerSecurityOptions). */
export function serverCredentials(options?: ServerSecurityOptions): grpc.ServerCredentials;
/** The message types, in the contract's order. */
export const TYPES: MessageType[];
/** The directory of the .proto files the client loads: the package's own copy when it was
 * installed from a packed tarball, else the repository's `proto/`. */
export const PROTO_ROOT: string;
