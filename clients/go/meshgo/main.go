// Command meshgo is a Go agent and client of the agent mesh, written against the contract in
// proto/ with plain gRPC: no SDK, only the Go code protoc generates from mesh/v1.
//
//	meshgo agent -broker 127.0.0.1:50051 -id GoExpertAgent -types stock_expert
//	meshgo request -broker 127.0.0.1:50051 -from GoClient -to PaymentAgent -action quote
//	meshgo groupchat -gateway 127.0.0.1:50052 -agents GoExpertAgent,IndustryExpertAgent -query "..."
//
// The agent runs its own gRPC server (the Agent service, health and reflection), registers
// that address with the broker, takes its deliveries on a Connect session and answers each
// REQUEST, HANDOFF and asked BROADCAST (a gather's copy, a group chat's question) with a
// RESPONSE under the message's correlation; everything else it acknowledges. It subscribes
// again when the broker goes away, for up to a minute (its health for mesh.v1.AgentService,
// which readiness asks, says NOT_SERVING meanwhile; "" says the process serves), and on
// SIGTERM or SIGINT says NOT_SERVING, ends its session (what it did not answer goes back to the queue), leaves the
// registry and exits 0. Deregistered by someone else (its subscription ended; with -push,
// the broker's NotifyDeregistered call), it says NOT_SERVING and registers no more.
//
// request asks again while the broker refuses for now (RESOURCE_EXHAUSTED, UNAVAILABLE):
// after RT-011's backoff of 100, 500 and 2000 ms, or the longer wait a refusal's RetryInfo
// asks for. groupchat starts its chat again, after the same waits, when the gateway refused
// it before it started (it already runs its limit: reason TOO_MANY_RUNS).
//
// TLS and credentials come from the variables every client of the mesh reads:
// AGENTMESH_TLS_CA, AGENTMESH_TLS_CLIENT_CERT and AGENTMESH_TLS_CLIENT_KEY,
// AGENTMESH_TLS_SERVER_NAME, AGENTMESH_TOKEN_FILE or AGENTMESH_TOKEN (and AGENTMESH_TLS_CERT
// and AGENTMESH_TLS_KEY for the agent's own server, mutual TLS with AGENTMESH_TLS_CA; its
// callers held to AGENTMESH_CREDENTIALS_FILE). Certificates, keys, CAs, the token file and
// the credentials file are read again when they change.
package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"

	meshv1 "agentmesh/gen/mesh/v1"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// The services whose health the agent reports (its own, and its process's readiness as
// the Python agents name it) and follows (the broker's).
const (
	agentService  = "mesh.v1.AgentService"
	agentsService = "agentmesh.agents"
	brokerService = "mesh.v1.BrokerService"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: meshgo agent|request|groupchat [flags]")
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "agent":
		err = runAgent(os.Args[2:])
	case "request":
		err = runRequest(os.Args[2:])
	case "groupchat":
		err = runGroupChat(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: agent, request or groupchat", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "meshgo:", describe(err))
		os.Exit(1)
	}
}

// describe says a gRPC error as "CODE: message", the code by its canonical name
// (NOT_FOUND), as the mesh's other clients say it.
func describe(err error) string {
	if s, ok := status.FromError(err); ok {
		return fmt.Sprintf("%s: %s", canonical(s.Code().String()), s.Message())
	}
	return err.Error()
}

// canonical turns Go's name of a status code ("DeadlineExceeded") into gRPC's
// ("DEADLINE_EXCEEDED").
func canonical(name string) string {
	var out strings.Builder
	for i, r := range name {
		if i > 0 && unicode.IsUpper(r) && unicode.IsLower(rune(name[i-1])) {
			out.WriteByte('_')
		}
		out.WriteRune(unicode.ToUpper(r))
	}
	return out.String()
}

// reconnectMax is the longest wait between two attempts to reach the broker, the
// connection's own and the agent's to subscribe or register again (the Python and Node.js
// clients wait as long).
const reconnectMax = 2 * time.Second

// targetProblem says what is wrong with an address for gRPC to dial it as meant, as the
// Python and Node.js clients say it, or "": it is empty, a URL (what buf curl is given: gRPC
// dials no http://), or a host:port whose port is past 65535.
func targetProblem(target string) string {
	if strings.TrimSpace(target) == "" {
		return "an address is required: host:port (or any gRPC target)"
	}
	lower := strings.ToLower(target)
	for _, scheme := range []string{"http://", "https://", "grpc://", "grpcs://"} {
		if strings.HasPrefix(lower, scheme) {
			rest := strings.TrimRight(target[len(scheme):], "/")
			return fmt.Sprintf("%s is a URL, not a gRPC target: give host:port (%s; TLS is set "+
				"apart, not by %s)", target, rest, target[:len(scheme)])
		}
	}
	for _, scheme := range []string{"dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:"} {
		if strings.HasPrefix(target, scheme) {
			return ""
		}
	}
	if strings.Contains(target, "://") {
		return ""
	}
	port := target[strings.LastIndex(target, ":")+1:]
	if port != "" && strings.Trim(port, "0123456789") == "" {
		if number, err := strconv.Atoi(port); err != nil || number < 1 || number > 65535 {
			return fmt.Sprintf("%s: a port is from 1 to 65535", target)
		}
	}
	return ""
}

// dial connects as every client of the mesh does, from the same variables: TLS when
// AGENTMESH_TLS_CA names the CA of the server's certificate (AGENTMESH_TLS_SERVER_NAME
// overrides the name checked), a client certificate for mutual TLS from
// AGENTMESH_TLS_CLIENT_CERT and AGENTMESH_TLS_CLIENT_KEY, and a bearer token on every call:
// what AGENTMESH_TOKEN_FILE holds, else AGENTMESH_TOKEN. The CA, the client certificate and
// the token file are read again when they change (renewed, rotated), without a restart.
func dial(ctx context.Context, target string) (*grpc.ClientConn, error) {
	if problem := targetProblem(target); problem != "" {
		return nil, errors.New(problem)
	}
	var options []grpc.DialOption
	if ca := os.Getenv("AGENTMESH_TLS_CA"); ca != "" {
		roots, err := renewedRoots(ca)
		if err != nil {
			return nil, err
		}
		config := &tls.Config{ServerName: os.Getenv("AGENTMESH_TLS_SERVER_NAME")}
		if cert := os.Getenv("AGENTMESH_TLS_CLIENT_CERT"); cert != "" {
			pair, err := renewedPair(cert, os.Getenv("AGENTMESH_TLS_CLIENT_KEY"))
			if err != nil {
				return nil, err
			}
			config.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				return pair.get(), nil
			}
		}
		options = append(options, grpc.WithTransportCredentials(&renewingTLS{roots: roots, config: config}))
	} else {
		options = append(options, grpc.WithInsecure())
	}
	if file := os.Getenv("AGENTMESH_TOKEN_FILE"); file != "" {
		token, err := newRenewed("the token file "+file, []string{file}, func() (string, error) {
			return readToken(file)
		})
		if err != nil {
			return nil, err
		}
		options = append(options, grpc.WithPerRPCCredentials(tokenFile{token}))
	} else if token := os.Getenv("AGENTMESH_TOKEN"); token != "" {
		options = append(options, grpc.WithPerRPCCredentials(bearer(token)))
	}
	// Reconnects as the other clients of the mesh do, every 0.1 s at first and at least every
	// 2 s: gRPC's default backoff (1 s, growing to 120 s) left an agent out of service for
	// longer than the broker was down.
	options = append(options, grpc.WithConnectParams(grpc.ConnectParams{
		Backoff: backoff.Config{
			BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: reconnectMax,
		},
		MinConnectTimeout: 20 * time.Second,
	}))
	// (Not blocking: a broker that cannot be reached fails the first call, UNAVAILABLE with
	// why, rather than the dial with a bare deadline.)
	return grpc.DialContext(ctx, target, options...)
}

// bearer sends its token as "authorization: Bearer <token>" on every call.
type bearer string

func (b bearer) GetRequestMetadata(ctx context.Context, uri ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity: false, as the mesh's other clients (a broker may take
// credentials over plaintext on a private network).
func (b bearer) RequireTransportSecurity() bool { return false }

// tokenFile sends the token its file holds now on every call.
type tokenFile struct{ token *renewed[string] }

func (t tokenFile) GetRequestMetadata(ctx context.Context, uri ...string) (map[string]string, error) {
	return bearer(t.token.get()).GetRequestMetadata(ctx, uri...)
}

func (t tokenFile) RequireTransportSecurity() bool { return false }

// readToken: the token a token file holds (its text, trimmed).
func readToken(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	token := strings.TrimSpace(string(data))
	if token == "" {
		return "", fmt.Errorf("the token file %s is empty", path)
	}
	return token, nil
}

// serverOptions: TLS for the agent's own server when AGENTMESH_TLS_CERT and
// AGENTMESH_TLS_KEY name its certificate and key, mutual TLS when AGENTMESH_TLS_CA names the
// CA its callers' certificates must be signed by (as a Python agent's server; not with
// AGENTMESH_TLS_CLIENT_AUTH=none), each read again when it changes (renewed): the connections
// made after use the new one. mutual says whether it requires its callers' certificates.
func serverOptions() (options []grpc.ServerOption, mutual bool, err error) {
	cert := os.Getenv("AGENTMESH_TLS_CERT")
	if cert == "" {
		return nil, false, nil
	}
	pair, err := renewedPair(cert, os.Getenv("AGENTMESH_TLS_KEY"))
	if err != nil {
		return nil, false, err
	}
	config := &tls.Config{GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
		return pair.get(), nil
	}}
	auth := os.Getenv("AGENTMESH_TLS_CLIENT_AUTH")
	if auth != "" && auth != "require" && auth != "none" {
		return nil, false, fmt.Errorf("AGENTMESH_TLS_CLIENT_AUTH must be require or none, not %q", auth)
	}
	if ca := os.Getenv("AGENTMESH_TLS_CA"); ca != "" && auth != "none" {
		roots, err := renewedRoots(ca)
		if err != nil {
			return nil, false, err
		}
		mutual = true
		config.ClientAuth = tls.RequireAndVerifyClientCert
		// (Each handshake's config is a clone of this one, not of the one gRPC makes of it:
		// it names HTTP/2 for ALPN itself, as gRPC's would.)
		config.NextProtos = []string{"h2"}
		config.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
			each := config.Clone()
			each.GetConfigForClient = nil
			each.ClientCAs = roots.get()
			return each, nil
		}
	}
	return []grpc.ServerOption{grpc.Creds(credentials.NewTLS(config))}, mutual, nil
}

// renewingTLS is TLS that checks the server against the CA its file holds now: each
// handshake goes through credentials made with the roots read last.
type renewingTLS struct {
	roots  *renewed[*x509.CertPool]
	config *tls.Config // all but the roots
	mu     sync.Mutex
	made   *x509.CertPool
	tls    credentials.TransportCredentials
}

func (r *renewingTLS) current() credentials.TransportCredentials {
	roots := r.roots.get()
	r.mu.Lock()
	defer r.mu.Unlock()
	if roots != r.made {
		config := r.config.Clone()
		config.RootCAs = roots
		r.tls, r.made = credentials.NewTLS(config), roots
	}
	return r.tls
}

func (r *renewingTLS) ClientHandshake(ctx context.Context, authority string, raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return r.current().ClientHandshake(ctx, authority, raw)
}

func (r *renewingTLS) ServerHandshake(raw net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return r.current().ServerHandshake(raw)
}

func (r *renewingTLS) Info() credentials.ProtocolInfo { return r.current().Info() }

func (r *renewingTLS) Clone() credentials.TransportCredentials {
	r.mu.Lock()
	defer r.mu.Unlock()
	return &renewingTLS{roots: r.roots, config: r.config.Clone()}
}

// OverrideServerName: gRPC's deprecated way of setting the name checked.
func (r *renewingTLS) OverrideServerName(name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.config.ServerName, r.made = name, nil
	return nil
}

// ---- credentials: the agent's server held to a credentials file -------------------------

// principal is who a token names in a credentials file: the agents it may act as, or any
// (admin: the broker pushing, the gateway).
type principal struct {
	name   string
	agents map[string]bool
	admin  bool
}

// credentialsFile is what a credentials file names: its principals by their token's SHA-256
// digest in hex, and by name (a client certificate's).
type credentialsFile struct {
	byDigest map[string]principal
	byName   map[string]principal
}

// readCredentials reads a credentials file (the broker's format: {"principals": [{name,
// token or token_sha256, agents, admin}]}).
func readCredentials(path string) (credentialsFile, error) {
	known := credentialsFile{byDigest: map[string]principal{}, byName: map[string]principal{}}
	data, err := os.ReadFile(path)
	if err != nil {
		return known, err
	}
	var file struct {
		Principals []struct {
			Name   string   `json:"name"`
			Token  *string  `json:"token"`
			Digest *string  `json:"token_sha256"`
			Agents []string `json:"agents"`
			Admin  bool     `json:"admin"`
		} `json:"principals"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		return known, fmt.Errorf("cannot read the credentials file %s: %v", path, err)
	}
	for i, entry := range file.Principals {
		if entry.Name == "" {
			return known, fmt.Errorf("principals[%d] has no name", i)
		}
		var digest string
		switch {
		case entry.Token != nil && entry.Digest != nil:
			return known, fmt.Errorf("principals[%d]: a token or its token_sha256, not both", i)
		case entry.Token != nil:
			if len(*entry.Token) < 16 {
				return known, fmt.Errorf("principals[%d].token must be at least 16 characters", i)
			}
			sum := sha256.Sum256([]byte(*entry.Token))
			digest = hex.EncodeToString(sum[:])
		case entry.Digest != nil:
			raw, err := hex.DecodeString(*entry.Digest)
			if err != nil || len(raw) != sha256.Size {
				return known, fmt.Errorf("principals[%d].token_sha256 must be a SHA-256 digest: 64 hex digits", i)
			}
			digest = hex.EncodeToString(raw)
		}
		agents := map[string]bool{}
		for _, agent := range entry.Agents {
			agents[agent] = true
		}
		who := principal{name: entry.Name, agents: agents, admin: entry.Admin}
		if digest != "" {
			known.byDigest[digest] = who
		}
		known.byName[entry.Name] = who
	}
	return known, nil
}

// guard holds the calls of the agent's server as a Python agent's server does, with a
// credentials file (principals, nil without one) or mutual TLS: a call needs a bearer token
// the file names or, with mutual TLS, a client certificate (named as a principal of the file,
// or acting as the agent its name is); UNAUTHENTICATED otherwise. A message is sent only as an
// agent its principal may act as (PERMISSION_DENIED otherwise). Health and reflection stay
// open, for the probes.
func guard(principals *renewed[credentialsFile], mutual bool) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req interface{}, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (interface{}, error) {
		if strings.HasPrefix(info.FullMethod, "/grpc.health.v1.Health/") || strings.HasPrefix(info.FullMethod, "/grpc.reflection.") {
			return handler(ctx, req)
		}
		var known credentialsFile
		if principals != nil {
			known = principals.get()
		}
		md, _ := metadata.FromIncomingContext(ctx)
		var token string
		if values := md.Get("authorization"); len(values) > 0 {
			if fields := strings.Fields(values[0]); len(fields) == 2 && strings.EqualFold(fields[0], "bearer") {
				token = fields[1]
			}
		}
		var caller principal
		found := false
		if token != "" {
			sum := sha256.Sum256([]byte(token))
			if caller, found = known.byDigest[hex.EncodeToString(sum[:])]; !found {
				return nil, status.Error(codes.Unauthenticated, "the token is not valid")
			}
		} else if mutual {
			names := certificateNames(ctx)
			for _, name := range names {
				if caller, found = known.byName[name]; found {
					break
				}
			}
			if !found && len(names) > 0 {
				caller, found = principal{name: names[0], agents: map[string]bool{names[0]: true}}, true
			}
		}
		if !found {
			wanted := "credentials required: a bearer token in the authorization metadata"
			if mutual {
				wanted += " or a client certificate"
			}
			return nil, status.Error(codes.Unauthenticated, wanted)
		}
		agent, what, acting := "", "", false
		switch r := req.(type) {
		case *meshv1.HandleMessageRequest:
			agent, what, acting = r.GetMessage().GetFromAgent(), "send", true
		case *meshv1.NotifyDeregisteredRequest:
			agent, what, acting = r.GetAgentId(), "deregister", true
		}
		if acting && !caller.admin && !caller.agents[agent] {
			shown := agent
			if shown == "" {
				shown = "(no agent)"
			}
			return nil, status.Errorf(codes.PermissionDenied, "%s may not %s as %s", caller.name, what, shown)
		}
		return handler(ctx, req)
	}
}

// certificateNames: the names a call's verified client certificate carries, its subject's CN
// then its DNS names (none without one).
func certificateNames(ctx context.Context) []string {
	caller, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	tlsInfo, ok := caller.AuthInfo.(credentials.TLSInfo)
	if !ok || len(tlsInfo.State.PeerCertificates) == 0 {
		return nil
	}
	leaf := tlsInfo.State.PeerCertificates[0]
	var names []string
	if leaf.Subject.CommonName != "" {
		names = append(names, leaf.Subject.CommonName)
	}
	return append(names, leaf.DNSNames...)
}

// ---- files read again when they change ----------------------------------------------------

// renewalLook: how often, at most, files are looked at again (a stat of each).
const renewalLook = time.Second

// renewed is what files make (a certificate, a token), read again when they change: looked
// at, at most every renewalLook, as it is asked for. Files changed into what cannot be used
// (written halfway, a key that is not the certificate's) are said, and what was read before
// stays in use.
type renewed[T any] struct {
	what   string
	paths  []string
	load   func() (T, error)
	mu     sync.Mutex
	stamp  string
	looked time.Time
	value  T
}

func newRenewed[T any](what string, paths []string, load func() (T, error)) (*renewed[T], error) {
	r := &renewed[T]{what: what, paths: paths, load: load, stamp: stampOf(paths), looked: time.Now()}
	value, err := load()
	if err != nil {
		return nil, err
	}
	r.value = value
	return r, nil
}

func (r *renewed[T]) get() T {
	r.mu.Lock()
	defer r.mu.Unlock()
	if time.Since(r.looked) < renewalLook {
		return r.value
	}
	r.looked = time.Now()
	stamp := stampOf(r.paths)
	if stamp == r.stamp {
		return r.value
	}
	r.stamp = stamp
	value, err := r.load()
	if err != nil {
		fmt.Fprintf(os.Stderr, "meshgo: %s changed into what cannot be used, so what was read before stays in use: %v\n", r.what, err)
		return r.value
	}
	r.value = value
	fmt.Fprintf(os.Stderr, "meshgo: %s was renewed\n", r.what)
	return value
}

// stampOf: what changes when a file does (a Secret's volume swaps a symlink: a new inode).
func stampOf(paths []string) string {
	var b strings.Builder
	for _, path := range paths {
		info, err := os.Stat(path)
		if err != nil {
			b.WriteString("-;")
			continue
		}
		var inode uint64
		if st, ok := info.Sys().(*syscall.Stat_t); ok {
			inode = st.Ino
		}
		fmt.Fprintf(&b, "%d:%d:%d;", inode, info.ModTime().UnixNano(), info.Size())
	}
	return b.String()
}

// renewedRoots: a CA bundle, read again when it changes.
func renewedRoots(ca string) (*renewed[*x509.CertPool], error) {
	return newRenewed("the CA "+ca, []string{ca}, func() (*x509.CertPool, error) {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, err
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s holds no PEM certificate", ca)
		}
		return roots, nil
	})
}

// renewedPair: a certificate and its key, read again when they change.
func renewedPair(cert, key string) (*renewed[*tls.Certificate], error) {
	return newRenewed("the certificate "+cert, []string{cert, key}, func() (*tls.Certificate, error) {
		pair, err := tls.LoadX509KeyPair(cert, key)
		return &pair, err
	})
}

// ---- the agent ----------------------------------------------------------------------------

type agent struct {
	id             string
	types          []string
	required       []string // content keys every REQUEST and HANDOFF to it must carry
	recommendation string
	confidence     float64
	address        string
	healthAddress  string        // of its plaintext health server, if it has one
	push           bool          // takes its messages by push: the broker calls its server
	off            chan struct{} // closed when the broker says the agent was deregistered
	toldOff        sync.Once
}

// answer is the agent's work: what it says about a message. Its recommendation and
// confidence are what a group chat counts; the rest tells what it saw.
func (a *agent) answer(m *meshv1.Message) map[string]interface{} {
	content := m.GetContent().AsMap()
	said, _ := content["query"].(string)
	if said == "" {
		said, _ = content["action"].(string)
	}
	action, _ := content["action"].(string)
	if action == "" {
		action = "response"
	}
	return map[string]interface{}{
		"action":         action,
		"status":         "COMPLETED",
		"recommendation": a.recommendation,
		"confidence":     a.confidence,
		"reasoning":      fmt.Sprintf("go saw: %s", said),
		"served_by":      a.id,
		"echo":           content,
	}
}

// reply is the RESPONSE due to m, or nil when none is: what is asked (a REQUEST, a HANDOFF,
// a BROADCAST that names where answers go) is answered; alerts and answers are not.
// kindOf is a message's type, an unset one read as the broker reads it.
func kindOf(m *meshv1.Message) meshv1.MessageType {
	kind := m.GetMessageType()
	if kind == meshv1.MessageType_MESSAGE_TYPE_UNSPECIFIED {
		kind = meshv1.MessageType_MESSAGE_TYPE_REQUEST
		if m.GetToAgent() == "broadcast" {
			kind = meshv1.MessageType_MESSAGE_TYPE_BROADCAST
		}
	}
	return kind
}

func (a *agent) reply(m *meshv1.Message) (*meshv1.Message, error) {
	asked := m.GetCorrelationId() != "" || m.GetReplyTo() != ""
	kind := kindOf(m)
	switch kind {
	case meshv1.MessageType_MESSAGE_TYPE_REQUEST, meshv1.MessageType_MESSAGE_TYPE_HANDOFF:
	case meshv1.MessageType_MESSAGE_TYPE_BROADCAST:
		if !asked {
			return nil, nil
		}
	default:
		return nil, nil
	}
	content, err := structpb.NewStruct(a.answer(m))
	if err != nil {
		return nil, err
	}
	to := m.GetReplyTo()
	if to == "" {
		to = m.GetFromAgent()
	}
	correlation := m.GetCorrelationId()
	if correlation == "" {
		correlation = m.GetMessageId()
	}
	return &meshv1.Message{
		FromAgent:     a.id,
		ToAgent:       to,
		MessageType:   meshv1.MessageType_MESSAGE_TYPE_RESPONSE,
		Content:       content,
		CorrelationId: correlation,
		Priority:      m.GetPriority(),
	}, nil
}

// HandleMessage and DescribeAgent: the Agent service, for callers that reach the agent
// directly (RT-011 peer-to-peer) rather than through its queue.
type agentServer struct {
	meshv1.UnimplementedAgentServiceServer
	agent *agent
}

func (s *agentServer) HandleMessage(
	ctx context.Context, req *meshv1.HandleMessageRequest,
) (*meshv1.HandleMessageResponse, error) {
	if violations := wireViolations(req.GetMessage()); len(violations) > 0 {
		return nil, invalidArgument(violations)
	}
	if violations := s.agent.directViolations(req.GetMessage()); len(violations) > 0 {
		return nil, invalidArgument(violations)
	}
	answer, err := s.agent.reply(req.GetMessage())
	if err != nil {
		return nil, err
	}
	return &meshv1.HandleMessageResponse{Response: answer}, nil
}

// directViolations is what keeps a message called to the agent's own server from being
// handled, as the broker would refuse it: RT-011's required fields, and an agent id other than
// the one this server serves.
func (a *agent) directViolations(m *meshv1.Message) []*errdetails.BadRequest_FieldViolation {
	var found []*errdetails.BadRequest_FieldViolation
	add := func(field, description string) {
		found = append(found, &errdetails.BadRequest_FieldViolation{
			Field: field, Description: description,
		})
	}
	if m.GetFromAgent() == "" {
		add("from_agent", "from_agent is required")
	}
	if m.GetToAgent() == "" {
		add("to_agent", "to_agent is required")
	}
	kind := kindOf(m)
	if m.GetContent() == nil {
		add("content", "content is required")
	} else {
		action, present := m.GetContent().GetFields()["action"]
		_, isString := action.GetKind().(*structpb.Value_StringValue)
		_, isNull := action.GetKind().(*structpb.Value_NullValue)
		switch {
		case !present || isNull || (isString && action.GetStringValue() == ""):
			if kind != meshv1.MessageType_MESSAGE_TYPE_BROADCAST {
				add("content.action", "content.action is required")
			}
		case !isString:
			add("content.action", "content.action must be a string")
		}
		parameters := m.GetContent().GetFields()["parameters"].GetStructValue()
		if kind == meshv1.MessageType_MESSAGE_TYPE_HANDOFF &&
			parameters.GetFields()["task_description"].GetStringValue() == "" {
			add("content.parameters.task_description", "task_description is required for handoff")
		}
		if kind == meshv1.MessageType_MESSAGE_TYPE_REQUEST ||
			kind == meshv1.MessageType_MESSAGE_TYPE_HANDOFF {
			for _, key := range a.required {
				value, present := m.GetContent().GetFields()[key]
				if _, isNull := value.GetKind().(*structpb.Value_NullValue); !present || isNull {
					add("content."+key, fmt.Sprintf("content.%s is required by %s", key, a.id))
				}
			}
		}
	}
	if m.GetToAgent() != "" && m.GetToAgent() != a.id {
		add("to_agent", fmt.Sprintf("this server serves %s, not %s", a.id, m.GetToAgent()))
	}
	return found
}

// unreadable holds, for each request of the Agent service that could not be read, why (its
// reading codec puts it, refuseUnreadable takes it out as the call goes on).
var unreadable sync.Map

// readingCodec is gRPC's own proto codec, but a request of the Agent service that cannot be
// read is kept in unreadable (and read as far as it could be) rather than refused INTERNAL.
type readingCodec struct{ encoding.Codec }

func (c readingCodec) Unmarshal(data []byte, v interface{}) error {
	err := c.Codec.Unmarshal(data, v)
	switch v.(type) {
	case *meshv1.HandleMessageRequest, *meshv1.DescribeAgentRequest,
		*meshv1.NotifyDeregisteredRequest:
		if err != nil {
			unreadable.Store(v, fmt.Sprintf("the request is not a valid %s: %v",
				proto.MessageName(v.(proto.Message)), err))
		}
		return nil
	}
	return err
}

func (c readingCodec) String() string { return c.Codec.Name() }

// refuseUnreadable answers INVALID_ARGUMENT to a request its codec could not read.
func refuseUnreadable(ctx context.Context, req interface{}, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (interface{}, error) {
	if why, found := unreadable.LoadAndDelete(req); found {
		return nil, invalidArgument([]*errdetails.BadRequest_FieldViolation{
			{Field: "", Description: why.(string)},
		})
	}
	return handler(ctx, req)
}

// Limits a message called to the agent's own server is held to, as by the broker and the
// Python agents (RT-011's defaults), and a Timestamp's range (0001-01-01 to 9999-12-31).
const (
	maxMessageBytes     = 1 << 20
	maxTTL              = 86400
	minTimestampSeconds = -62135596800
	maxTimestampSeconds = 253402300799
)

// wireViolations is what in a message called to the agent's own server the Python agents
// refuse as they read it, in their words: a type or priority the contract does not define,
// a timestamp (or deliver_at) out of a Timestamp's range, a ttl below 0 or past a day, a message past 1 MiB,
// a number JSON cannot write.
func wireViolations(m *meshv1.Message) []*errdetails.BadRequest_FieldViolation {
	var found []*errdetails.BadRequest_FieldViolation
	add := func(field, description string) {
		found = append(found, &errdetails.BadRequest_FieldViolation{
			Field: field, Description: description,
		})
	}
	if _, known := meshv1.MessageType_name[int32(m.GetMessageType())]; !known {
		add("message_type", fmt.Sprintf("message_type %d is not defined (known: %s)",
			m.GetMessageType(), "REQUEST=1, RESPONSE=2, BROADCAST=3, HANDOFF=4, ERROR=5, ACK=6"))
	}
	if _, known := meshv1.Priority_name[int32(m.GetPriority())]; !known {
		add("priority", fmt.Sprintf("priority %d is not defined (known: %s)",
			m.GetPriority(), "HIGH=1, MEDIUM=2, LOW=3"))
	}
	for _, stamp := range []struct {
		name  string
		value *timestamppb.Timestamp
	}{{"timestamp", m.GetTimestamp()}, {"deliver_at", m.GetDeliverAt()}} {
		ts := stamp.value
		if ts != nil && (ts.GetSeconds() < minTimestampSeconds ||
			ts.GetSeconds() > maxTimestampSeconds || ts.GetNanos() < 0 || ts.GetNanos() > 999999999) {
			add(stamp.name, fmt.Sprintf("%s must be from 0001-01-01T00:00:00Z to "+
				"9999-12-31T23:59:59.999999999Z (seconds %d, nanos %d)",
				stamp.name, ts.GetSeconds(), ts.GetNanos()))
		} else if stamp.name == "deliver_at" && ts != nil &&
			time.Until(ts.AsTime()) > maxTTL*time.Second {
			add("deliver_at", fmt.Sprintf("deliver_at must be at most %d seconds ahead", maxTTL))
		}
	}
	if m.GetTtl() < 0 {
		add("ttl", "ttl must not be negative")
	} else if m.GetTtl() > maxTTL {
		add("ttl", fmt.Sprintf("ttl must be at most %d seconds", maxTTL))
	}
	if size := proto.Size(m); size > maxMessageBytes {
		add("message", fmt.Sprintf("message is %d bytes; the limit is %d bytes", size, maxMessageBytes))
	}
	for _, part := range []struct {
		name  string
		value *structpb.Struct
	}{{"content", m.GetContent()}, {"metadata", m.GetMetadata()}} {
		if where := nonFinite(structpb.NewStructValue(part.value), "message."+part.name); where != "" {
			add(where, "the request is not a valid mesh.v1.HandleMessageRequest: "+where+
				" is NaN or Infinity, which JSON has no way to write")
		}
	}
	return found
}

// nonFinite is where in value a number is NaN or an infinity, or "".
func nonFinite(value *structpb.Value, at string) string {
	switch kind := value.GetKind().(type) {
	case *structpb.Value_NumberValue:
		if math.IsNaN(kind.NumberValue) || math.IsInf(kind.NumberValue, 0) {
			return at
		}
	case *structpb.Value_StructValue:
		keys := make([]string, 0, len(kind.StructValue.GetFields()))
		for key := range kind.StructValue.GetFields() {
			keys = append(keys, key)
		}
		sort.Strings(keys) // (the first in key order, whatever the map's)
		for _, key := range keys {
			if where := nonFinite(kind.StructValue.GetFields()[key], at+"."+key); where != "" {
				return where
			}
		}
	case *structpb.Value_ListValue:
		for i, item := range kind.ListValue.GetValues() {
			if where := nonFinite(item, at+"."+strconv.Itoa(i)); where != "" {
				return where
			}
		}
	}
	return ""
}

// invalidArgument is INVALID_ARGUMENT with the rich status every server of the mesh sends:
// the reason VALIDATION_FAILED and a field violation per problem.
func invalidArgument(violations []*errdetails.BadRequest_FieldViolation) error {
	descriptions := make([]string, len(violations))
	for i, v := range violations {
		descriptions[i] = v.GetDescription()
	}
	st := status.New(codes.InvalidArgument, strings.Join(descriptions, "; "))
	rich, err := st.WithDetails(
		&errdetails.ErrorInfo{Reason: "VALIDATION_FAILED", Domain: "agentmesh.dev"},
		&errdetails.BadRequest{FieldViolations: violations},
	)
	if err != nil {
		return st.Err()
	}
	return rich.Err()
}

func (s *agentServer) DescribeAgent(
	ctx context.Context, req *meshv1.DescribeAgentRequest,
) (*meshv1.DescribeAgentResponse, error) {
	return &meshv1.DescribeAgentResponse{Card: &meshv1.AgentCard{
		AgentId:     s.agent.id,
		AgentTypes:  s.agent.types,
		Description: "A Go agent on plain gRPC",
	}}, nil
}

// NotifyDeregistered is the broker's notice that the agent was taken off the mesh, sent to
// the instances it pushes to (they hold no session whose end would tell them). One that pulls
// learns it as its subscription ends instead.
func (s *agentServer) NotifyDeregistered(
	ctx context.Context, req *meshv1.NotifyDeregisteredRequest,
) (*meshv1.NotifyDeregisteredResponse, error) {
	if req.GetAgentId() != s.agent.id {
		return nil, invalidArgument([]*errdetails.BadRequest_FieldViolation{{
			Field:       "agent_id",
			Description: fmt.Sprintf("this server serves %s, not %s", s.agent.id, req.GetAgentId()),
		}})
	}
	if s.agent.push {
		s.agent.toldOff.Do(func() { close(s.agent.off) })
	}
	return &meshv1.NotifyDeregisteredResponse{}, nil
}

// takenOff says that the agent was taken off the mesh on purpose (agentmesh deregister): it
// is not registered again behind the back of whoever did it, and its server stays, not ready,
// until stopped.
func (a *agent) takenOff() {
	fmt.Fprintf(os.Stderr, "%s was deregistered: it takes no more messages (start it again to register it again)\n", a.id)
}

// announce says where the agent serves, once it takes its messages.
func (a *agent) announce() {
	fmt.Printf("%s serving on %s\n", a.id, a.address)
	if a.healthAddress != "" {
		fmt.Printf("%s health on %s\n", a.id, a.healthAddress)
	}
}

func runAgent(args []string) error {
	flags := flag.NewFlagSet("agent", flag.ExitOnError)
	broker := flags.String("broker", envOr("AGENTMESH_BROKER", "127.0.0.1:50051"), "broker host:port")
	id := flags.String("id", "GoAgent", "agent id")
	types := flags.String("types", "", "agent types, comma-separated")
	require := flags.String("require", "",
		"content keys every request and hand-off to the agent must carry, comma-separated")
	recommendation := flags.String("recommendation", "Buy AAPL", "what the agent recommends")
	confidence := flags.Float64("confidence", 0.7, "how sure it is (0 to 1)")
	host := flags.String("host", "127.0.0.1", "host of the agent's own server")
	push := flags.Bool("push", false,
		"register for push delivery: the broker calls this server's HandleMessage, no session")
	healthPort := flags.String("health-port", envOr("AGENTMESH_AGENT_HEALTH_PORT", "-1"),
		"port of a plaintext server of grpc.health.v1 alone beside a TLS one, for probes that "+
			"cannot speak TLS: 0 any free port, -1 none")
	flags.Parse(args)
	healthAt, err := strconv.Atoi(*healthPort)
	if err != nil || healthAt < -1 || healthAt > 65535 {
		return fmt.Errorf("-health-port must be a port, 0 for any free one, or -1 for none (got %q)", *healthPort)
	}

	a := &agent{id: *id, recommendation: *recommendation, confidence: *confidence, push: *push,
		off: make(chan struct{})}
	if *types != "" {
		a.types = strings.Split(*types, ",")
	}
	if *require != "" {
		a.required = strings.Split(*require, ",")
	}
	listener, err := net.Listen("tcp", net.JoinHostPort(*host, "0"))
	if err != nil {
		return err
	}
	a.address = listener.Addr().String()
	options, mutual, err := serverOptions()
	if err != nil {
		return err
	}
	var principals *renewed[credentialsFile]
	if file := os.Getenv("AGENTMESH_CREDENTIALS_FILE"); file != "" {
		principals, err = newRenewed("the credentials file "+file, []string{file}, func() (credentialsFile, error) {
			return readCredentials(file)
		})
		if err != nil {
			return err
		}
	}
	// A request that cannot be read is refused INVALID_ARGUMENT, as by every server of the
	// mesh (grpc-go answers INTERNAL); then the caller's credentials, when they are asked for.
	interceptors := []grpc.UnaryServerInterceptor{refuseUnreadable}
	if principals != nil || mutual {
		interceptors = append(interceptors, guard(principals, mutual))
	}
	options = append(options, grpc.CustomCodec(readingCodec{encoding.GetCodec("proto")}),
		grpc.ChainUnaryInterceptor(interceptors...))
	server := grpc.NewServer(options...)
	meshv1.RegisterAgentServiceServer(server, &agentServer{agent: a})
	// The server as a whole ("", which liveness asks) serves until it stops; the Agent
	// service (readiness) only while the agent takes its messages: subscribed on a session,
	// or registered for push with a broker that serves. So does agentmesh.agents, which
	// speaks for every agent of the process (one here), as the Python agents say it.
	healthy := health.NewServer()
	healthpb.RegisterHealthServer(server, healthy)
	ready := func(yes bool) {
		status := healthpb.HealthCheckResponse_NOT_SERVING
		if yes {
			status = healthpb.HealthCheckResponse_SERVING
		}
		healthy.SetServingStatus(agentService, status)
		healthy.SetServingStatus(agentsService, status)
	}
	ready(false)
	reflection.Register(server)
	go server.Serve(listener)
	// A health port: the same statuses, in plaintext, for probes that cannot speak TLS (a
	// kubelet's gRPC probe).
	var healthServer *grpc.Server
	if healthAt >= 0 {
		healthListener, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(healthAt)))
		if err != nil {
			return err
		}
		healthServer = grpc.NewServer()
		healthpb.RegisterHealthServer(healthServer, healthy)
		reflection.Register(healthServer)
		go healthServer.Serve(healthListener)
		a.healthAddress = healthListener.Addr().String()
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	conn, err := dial(ctx, *broker)
	if err != nil {
		return err
	}
	defer conn.Close()
	brokerClient := meshv1.NewBrokerServiceClient(conn)

	announced, gone := false, false // gone: deregistered, by someone else
	var lost time.Time
	if *push {
		pushed, stopPushed := context.WithCancel(ctx)
		go func() {
			select {
			case <-a.off: // (told it was deregistered)
				stopPushed()
			case <-pushed.Done():
			}
		}()
		a.keepRegistered(pushed, brokerClient, healthpb.NewHealthClient(conn), ready)
		stopPushed()
		if ctx.Err() == nil {
			ready(false)
			a.takenOff()
			gone = true
			<-ctx.Done()
		}
	}
	for delay := 100 * time.Millisecond; !*push; {
		err := a.serveSession(ctx, brokerClient, func() {
			ready(true)
			lost = time.Time{}
			delay = 100 * time.Millisecond
			if !announced {
				announced = true
				a.announce()
			}
		})
		if ctx.Err() != nil {
			break
		}
		ready(false)
		var off *deregistered
		if errors.As(err, &off) {
			a.takenOff()
			gone = true
			<-ctx.Done()
			break
		}
		if lost.IsZero() {
			lost = time.Now()
		}
		// Never subscribed for a minute: the broker's address leads nowhere, and the start
		// fails. Once it has served, the agent waits for its broker however long it is away,
		// not ready meanwhile, as the Python and Node.js agents do (exiting, it would be
		// restarted with a growing back-off, and be back long after the broker).
		if !announced && time.Since(lost) > time.Minute {
			return fmt.Errorf("could not subscribe for a minute: %s", describe(err))
		}
		fmt.Fprintf(os.Stderr, "%s: session ended (%s); subscribing again in %s\n", a.id, describe(err), delay)
		select {
		case <-time.After(delay):
		case <-ctx.Done():
		}
		if delay *= 2; delay > reconnectMax {
			delay = reconnectMax
		}
	}

	// Stopping: not serving first, then out of the registry (unless out already), then the
	// server.
	healthy.Shutdown()
	leave, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if !gone {
		if _, err := brokerClient.DeregisterAgent(leave, &meshv1.DeregisterAgentRequest{
			AgentId: a.id, Address: a.address,
		}); err != nil {
			fmt.Fprintf(os.Stderr, "%s: could not deregister: %s\n", a.id, describe(err))
		}
	}
	server.GracefulStop()
	if healthServer != nil {
		healthServer.GracefulStop()
	}
	fmt.Printf("%s stopped\n", a.id)
	return nil
}

// keepRegistered registers the agent for push delivery (the broker calls its server's
// HandleMessage) and watches the broker's health until ctx is done: the process keeps no
// other stream to the broker, and a broker restarted on the memory store forgot the agent,
// which registers again once the broker serves. ready says whether it takes its messages.
func (a *agent) keepRegistered(
	ctx context.Context, broker meshv1.BrokerServiceClient, health healthpb.HealthClient,
	ready func(bool),
) {
	registered, announced := false, false
	for delay := 100 * time.Millisecond; ctx.Err() == nil; {
		if !registered {
			_, err := broker.RegisterAgent(ctx, &meshv1.RegisterAgentRequest{Agent: &meshv1.AgentInfo{
				AgentId: a.id, AgentTypes: a.types, Address: a.address, RequiredFields: a.required,
				DeliveryMode: meshv1.DeliveryMode_DELIVERY_MODE_PUSH,
			}})
			if err == nil {
				registered = true
				ready(true)
				delay = 100 * time.Millisecond
				if !announced {
					announced = true
					a.announce() // (taking its messages by push)
				}
			} else if ctx.Err() == nil {
				fmt.Fprintf(os.Stderr, "%s: could not register (%s); again in %s\n", a.id, describe(err), delay)
			}
		}
		if registered {
			// Until the broker goes away or says it does not serve (stopping, or its store
			// away): then the agent registers again once it can.
			watch, err := health.Watch(ctx, &healthpb.HealthCheckRequest{Service: brokerService})
			for err == nil {
				var reply *healthpb.HealthCheckResponse
				if reply, err = watch.Recv(); err == nil &&
					reply.Status != healthpb.HealthCheckResponse_SERVING {
					err = fmt.Errorf("the broker says %s", reply.Status)
				}
			}
			if ctx.Err() != nil {
				return
			}
			registered = false // a restarted broker may have forgotten us
			ready(false)
		}
		select {
		case <-time.After(delay):
		case <-ctx.Done():
		}
		if delay *= 2; delay > reconnectMax {
			delay = reconnectMax
		}
	}
}

// deregistered is why a session ended when the broker ended its subscription: the agent was
// deregistered (NOT_FOUND, reason AGENT_DEREGISTERED).
type deregistered struct{ said string }

func (d *deregistered) Error() string { return d.said }

// serveSession registers the agent, subscribes it on a Connect session and answers its
// deliveries until the session ends (the error says why) or ctx is done.
func (a *agent) serveSession(
	ctx context.Context, broker meshv1.BrokerServiceClient, subscribed func(),
) error {
	if _, err := broker.RegisterAgent(ctx, &meshv1.RegisterAgentRequest{Agent: &meshv1.AgentInfo{
		AgentId: a.id, AgentTypes: a.types, Address: a.address, RequiredFields: a.required,
	}}); err != nil {
		return err
	}
	sessionCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	session, err := broker.Connect(sessionCtx)
	if err != nil {
		return err
	}
	var writing sync.Mutex // (a gRPC stream takes one writer at a time)
	write := func(frame *meshv1.ConnectRequest) error {
		writing.Lock()
		defer writing.Unlock()
		return session.Send(frame)
	}
	if err := write(&meshv1.ConnectRequest{Seq: 1, Frame: &meshv1.ConnectRequest_Subscribe{
		// Naming its instance: should this process die, the broker takes it off the agent's.
		Subscribe: &meshv1.SubscribeRequest{AgentId: a.id, MaxInFlight: 16, Instance: a.address},
	}}); err != nil {
		return err
	}
	for {
		frame, err := session.Recv()
		if err == io.EOF {
			return errors.New("the broker ended the session")
		}
		if err != nil {
			return err
		}
		switch f := frame.GetFrame().(type) {
		case *meshv1.ConnectResponse_Accepted:
			if frame.GetSeq() == 1 {
				subscribed()
			}
		case *meshv1.ConnectResponse_Error:
			if frame.GetSeq() == 1 {
				return fmt.Errorf("subscribe refused: %s", f.Error.GetMessage())
			}
			// A frame sent without waiting (an answer) was refused: say so, go on.
			fmt.Fprintf(os.Stderr, "%s: the broker refused a frame: %s\n", a.id, f.Error.GetMessage())
		case *meshv1.ConnectResponse_Ended:
			// The broker ended the subscription: the agent was deregistered.
			return &deregistered{f.Ended.GetError().GetMessage()}
		case *meshv1.ConnectResponse_Delivery:
			if err := a.settle(f.Delivery.GetMessage(), write); err != nil {
				return err
			}
		case *meshv1.ConnectResponse_Deliveries:
			for _, d := range f.Deliveries.GetDeliveries() {
				if err := a.settle(d.GetMessage(), write); err != nil {
					return err
				}
			}
		}
	}
}

// settle answers a delivery (the answer acknowledges it) or acknowledges it.
func (a *agent) settle(m *meshv1.Message, write func(*meshv1.ConnectRequest) error) error {
	answer, err := a.reply(m)
	if err != nil {
		return err
	}
	if answer != nil && answer.GetCorrelationId() == m.GetMessageId() {
		return write(&meshv1.ConnectRequest{Frame: &meshv1.ConnectRequest_Send{Send: answer}})
	}
	if answer != nil { // (answers another's question: this delivery still needs its ack)
		if err := write(&meshv1.ConnectRequest{Frame: &meshv1.ConnectRequest_Send{Send: answer}}); err != nil {
			return err
		}
	}
	return write(&meshv1.ConnectRequest{Frame: &meshv1.ConnectRequest_Ack{
		Ack: &meshv1.AckRequest{AgentId: a.id, MessageIds: []string{m.GetMessageId()}},
	}})
}

// ---- the client ---------------------------------------------------------------------------

// retryBackoff is RT-011's retry_backoff_ms: the waits before the three retries of a call the
// broker refused for now (RESOURCE_EXHAUSTED: a queue full; UNAVAILABLE: the broker away or
// stopping). A refusal whose google.rpc.RetryInfo asks for longer gets that, up to
// maxRetryDelay.
var retryBackoff = []time.Duration{100 * time.Millisecond, 500 * time.Millisecond, 2 * time.Second}

const maxRetryDelay = time.Minute

// withRetry makes the call, and makes it again after each of retryBackoff's waits while
// refused says it was refused for now; each retry is said on stderr. The last refusal is
// returned.
func withRetry(ctx context.Context, refused func(error) bool, call func() error) error {
	for attempt := 0; ; attempt++ {
		err := call()
		if err == nil || !refused(err) || attempt >= len(retryBackoff) {
			return err
		}
		wait := retryWait(retryBackoff[attempt], err)
		fmt.Fprintf(os.Stderr, "meshgo: retry %d/%d in %d ms after %s\n",
			attempt+1, len(retryBackoff), wait.Milliseconds(), describe(err))
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return err
		}
	}
}

// brokerRefused says whether the broker refused a call for now: a queue full
// (RESOURCE_EXHAUSTED) or the broker away or stopping (UNAVAILABLE).
func brokerRefused(err error) bool {
	code := status.Code(err)
	return code == codes.ResourceExhausted || code == codes.Unavailable
}

// tooManyRuns is the reason of the gateway's refusal of a run before it started (it already
// runs its limit): the one failure of a pattern run that is safe to try again.
const tooManyRuns = "TOO_MANY_RUNS"

// reasonOf is the reason of a failed call's google.rpc.ErrorInfo ("" without one).
func reasonOf(err error) string {
	s, _ := status.FromError(err)
	for _, detail := range s.Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok {
			return info.GetReason()
		}
	}
	return ""
}

// retryWait is the wait before a retry: the backoff, or what the refusal's RetryInfo asks
// when that is longer, up to maxRetryDelay.
func retryWait(backoff time.Duration, err error) time.Duration {
	s, _ := status.FromError(err)
	for _, detail := range s.Details() {
		if info, ok := detail.(*errdetails.RetryInfo); ok && info.GetRetryDelay() != nil {
			asked := info.GetRetryDelay().AsDuration()
			if asked > maxRetryDelay {
				asked = maxRetryDelay
			}
			if asked > backoff {
				return asked
			}
			return backoff
		}
	}
	return backoff
}

// newMessageID is a random UUID (version 4), the form of the ids the broker gives.
func newMessageID() (string, error) {
	var raw [16]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", err
	}
	raw[6] = raw[6]&0x0f | 0x40 // version 4
	raw[8] = raw[8]&0x3f | 0x80 // RFC 4122 variant
	h := hex.EncodeToString(raw[:])
	return h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:], nil
}

func runRequest(args []string) error {
	flags := flag.NewFlagSet("request", flag.ExitOnError)
	broker := flags.String("broker", envOr("AGENTMESH_BROKER", "127.0.0.1:50051"), "broker host:port")
	from := flags.String("from", "GoClient", "the sender's agent id")
	to := flags.String("to", "", "the agent asked")
	action := flags.String("action", "", "content.action")
	params := flags.String("params", "{}", "content.parameters, a JSON object")
	timeout := flags.Duration("timeout", 10*time.Second, "how long to wait for the answer")
	flags.Parse(args)

	var parameters map[string]interface{}
	if err := json.Unmarshal([]byte(*params), &parameters); err != nil {
		return fmt.Errorf("-params is not a JSON object: %w", err)
	}
	content, err := structpb.NewStruct(map[string]interface{}{"action": *action, "parameters": parameters})
	if err != nil {
		return err
	}
	ctx := context.Background()
	conn, err := dial(ctx, *broker)
	if err != nil {
		return err
	}
	defer conn.Close()
	client := meshv1.NewBrokerServiceClient(conn)
	// Every attempt is the same request (its id and correlation), so that a retry after a
	// call whose fate is unknown cannot be taken for a second question.
	id, err := newMessageID()
	if err != nil {
		return err
	}
	request := &meshv1.SendRequestRequest{Message: &meshv1.Message{
		MessageId: id, CorrelationId: id, FromAgent: *from, ToAgent: *to,
		MessageType: meshv1.MessageType_MESSAGE_TYPE_REQUEST, Content: content,
	}}
	var answer *meshv1.SendRequestResponse
	err = withRetry(ctx, brokerRefused, func() error {
		asking, cancelAsk := context.WithTimeout(ctx, *timeout) // (the broker waits as long)
		defer cancelAsk()
		answer, err = client.SendRequest(asking, request)
		return err
	})
	if err != nil {
		return err
	}
	out, err := protojson.Marshal(answer.GetResponse())
	if err != nil {
		return err
	}
	fmt.Println(string(out))
	return nil
}

func runGroupChat(args []string) error {
	flags := flag.NewFlagSet("groupchat", flag.ExitOnError)
	gateway := flags.String("gateway", envOr("AGENTMESH_GATEWAY", "127.0.0.1:50052"), "gateway host:port")
	agents := flags.String("agents", "", "the group's agent ids, comma-separated")
	query := flags.String("query", "", "the question")
	label := flags.String("label", "", "plural noun for the options, e.g. stocks")
	flags.Parse(args)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := dial(ctx, *gateway)
	if err != nil {
		return err
	}
	defer conn.Close()
	client := meshv1.NewGatewayServiceClient(conn)
	request := &meshv1.RunGroupChatRequest{
		AgentIds: strings.Split(*agents, ","), Query: *query, OptionLabel: *label,
	}
	// A run the gateway refused before it started (it runs its limit) is started again; a
	// run that failed once it streamed is not: it may have done part of its work.
	streamed := false
	refused := func(err error) bool { return !streamed && reasonOf(err) == tooManyRuns }
	return withRetry(ctx, refused, func() error {
		stream, err := client.RunGroupChat(ctx, request)
		if err != nil {
			return err
		}
		for {
			answer, err := stream.Recv()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return err
			}
			streamed = true
			if err := printEvent(answer.GetEvent()); err != nil {
				return err
			}
		}
	})
}

// printEvent prints a group chat's event as a line (and its aggregate after the RESULT); a
// FAILED result is an error, so that a script hears of it.
func printEvent(event *meshv1.PatternEvent) error {
	kind := strings.TrimPrefix(event.GetKind().String(), "EVENT_KIND_")
	fmt.Printf("%s %s\n", kind, event.GetSummary())
	if kind == "RESULT" {
		result := event.GetData().AsMap()
		data, err := json.Marshal(result["aggregate"])
		if err != nil {
			return err
		}
		fmt.Printf("AGGREGATE %s\n", data)
		if result["status"] == "FAILED" { // (no agent answered: a script hears of it)
			return fmt.Errorf("the group chat failed: %s", event.GetSummary())
		}
	}
	return nil
}

func envOr(name, otherwise string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return otherwise
}
