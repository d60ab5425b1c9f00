/**
 * edgepg-proxy's settings: one table gives each its flag, default, help and group, so parsing
 * (config.ts), `--help` and the configuration reference (scripts/docs.ts) cannot drift apart. Every
 * environment variable is EDGEPG_ and its flag's name (`--pool-size`: EDGEPG_POOL_SIZE).
 */
export interface Setting {
  group: keyof typeof GROUPS
  flag: string
  arg?: string
  kind: 'address' | 'listen' | 'addresses' | 'list' | 'count' | 'ms' | 'bytes' | 'file' | 'path' | 'text' | 'sslmode' | 'choice' | 'switch'
  default?: string
  help: string
}

/** --help's and the reference's sections, in their order. */
export const GROUPS = {
  essentials: 'Essentials',
  tls: 'TLS',
  limits: 'Limits',
  pool: 'Pool',
  tokens: 'Tokens (signed JWTs instead of passwords)',
  replicas: 'Replicas',
  sql: 'POST /sql',
  observability: 'Observability',
}

const TABLE = {
  upstream: { group: 'essentials', flag: 'upstream', arg: 'host:port', kind: 'address', help: 'Postgres to relay to (required)' },
  listen: { group: 'essentials', flag: 'listen', arg: '[host:]port', kind: 'listen', default: '127.0.0.1:8080', help: 'where to accept WebSockets (0.0.0.0:PORT for remote clients)' },
  allow: { group: 'essentials', flag: 'allow', arg: 'host:port', kind: 'addresses', help: 'another upstream clients may name (?address= on /v1 and /v2, the connection string on /sql; repeatable; env: comma-separated)' },
  allowOrigin: { group: 'essentials', flag: 'allow-origin', arg: 'origin', kind: 'list', help: 'browser Origin allowed to connect (repeatable; * for any); requests without Origin are always allowed' },
  workers: { group: 'essentials', flag: 'workers', arg: 'n', kind: 'count', default: 'cores', help: "processes accepting on the one port (cores: the machine's, at most --pool-size); limits hold for the proxy as a whole" },
  cert: { group: 'tls', flag: 'cert', arg: 'file', kind: 'file', help: 'TLS certificate chain (PEM): serve wss:// and https://; reloaded on SIGHUP' },
  key: { group: 'tls', flag: 'key', arg: 'file', kind: 'file', help: 'TLS private key (PEM), with --cert' },
  upstreamSslmode: { group: 'tls', flag: 'upstream-sslmode', arg: 'mode', kind: 'sslmode', default: 'disable', help: 'TLS to Postgres: disable, require, verify-ca or verify-full' },
  upstreamCa: { group: 'tls', flag: 'upstream-ca', arg: 'file', kind: 'file', help: "CA (PEM) for Postgres's certificate: for verify-ca / verify-full, and clients whose ssl verifies it" },
  allowInsecurePasswords: { group: 'tls', flag: 'allow-insecure-passwords', kind: 'switch', help: 'accept passwords over plain ws:// from non-loopback clients (TLS ends in front)' },
  maxSessions: { group: 'limits', flag: 'max-sessions', arg: 'n', kind: 'count', default: '10000', help: 'concurrent sessions in all; more are refused with HTTP 503' },
  maxSessionsPerIp: { group: 'limits', flag: 'max-sessions-per-ip', arg: 'n', kind: 'count', default: '100', help: 'concurrent sessions from one client address; more get HTTP 429' },
  maxLogins: { group: 'limits', flag: 'max-logins', arg: 'n', kind: 'count', default: '64', help: 'logins waiting on Postgres at once (connected, not yet accepted); more wait their turn' },
  maxLoginsPerIp: { group: 'limits', flag: 'max-logins-per-ip', arg: 'n', kind: 'count', default: '8', help: 'logins waiting on Postgres at once from one client address; more wait their turn' },
  maxCancelsPerIp: { group: 'limits', flag: 'max-cancels-per-ip', arg: 'n', kind: 'count', default: '20', help: 'CancelRequests a second from one client address; more are dropped' },
  handshakeTimeout: { group: 'limits', flag: 'handshake-timeout', arg: 'duration', kind: 'ms', default: '10s', help: 'time a client has from connecting to finishing its Postgres startup' },
  idleTimeout: { group: 'limits', flag: 'idle-timeout', arg: 'duration', kind: 'ms', default: '15m', help: 'close a session with no traffic either way for this long (0: never); a session that LISTENs through the proxy waits as long as it likes' },
  maxMessageBytes: { group: 'limits', flag: 'max-message-bytes', arg: 'size', kind: 'bytes', default: '64MiB', help: 'largest WebSocket message accepted from a logged-in client (before login: 64 KiB)' },
  maxClientBuffer: { group: 'limits', flag: 'max-client-buffer', arg: 'size', kind: 'bytes', default: '256MiB', help: "bytes all clients' unfinished messages and /sql bodies may hold; a message that does not fit is refused (1009)" },
  shutdownGrace: { group: 'limits', flag: 'shutdown-grace', arg: 'duration', kind: 'ms', default: '10s', help: 'on SIGTERM, time running sessions get to finish before close code 1001' },
  poolMode: { group: 'pool', flag: 'pool-mode', arg: 'mode', kind: 'choice', default: 'transaction', help: 'session: a session holds its backend to its end; transaction: only while it runs something' },
  poolSize: { group: 'pool', flag: 'pool-size', arg: 'n', kind: 'count', default: '20', help: 'backends per user, database and password: in transaction mode all, idle or lent; in session mode those kept idle (and /sql requests at once)' },
  poolTimeout: { group: 'pool', flag: 'pool-timeout', arg: 'duration', kind: 'ms', default: '5s', help: 'transaction mode: longest wait for a backend, then SQLSTATE 53300' },
  idleInTransactionTimeout: { group: 'pool', flag: 'idle-in-transaction-timeout', arg: 'duration', kind: 'ms', default: '1m', help: 'transaction mode: end a session idle inside a transaction this long, rolled back, as Postgres would (0: never)' },
  maxBackendsPerClient: { group: 'pool', flag: 'max-backends-per-client', arg: 'n', kind: 'count', default: 'a quarter of --pool-size', help: "transaction mode: a key's backends one client (a token's subject, else its address) holds while another client waits (alone it may hold all); the keys it keeps warm past --pool-idle-timeout (those it used last); and, while the pool is full, its connections outside it" },
  maxPinnedSessions: { group: 'pool', flag: 'max-pinned-sessions', arg: 'n', kind: 'count', default: 'a quarter of --pool-size', help: "transaction mode: a key's sessions kept on their backend for state they hold; one more is closed with 53400" },
  listenBuffer: { group: 'pool', flag: 'listen-buffer', arg: 'size', kind: 'bytes', default: '1MiB', help: 'transaction mode: bytes of notifications a listening session may fall behind by; past it the session is closed (53400) rather than any other listener held back' },
  poolStatements: { group: 'pool', flag: 'pool-statements', arg: 'n', kind: 'count', default: '100', help: "transaction mode: named statements each backend keeps for its sessions" },
  poolMaxBackends: { group: 'pool', flag: 'pool-max-backends', arg: 'n', kind: 'count', default: '100', help: 'backends the pool owns in all (idle or lent): a login past it closes the idle one used longest ago, and with none idle gets a connection of its own' },
  poolIdleTimeout: { group: 'pool', flag: 'pool-idle-timeout', arg: 'duration', kind: 'ms', default: '1m', help: "close a pooled backend idle this long (a key's last, used within --pool-keep-warm, is kept)" },
  poolMaxLifetime: { group: 'pool', flag: 'pool-max-lifetime', arg: 'duration', kind: 'ms', default: '30m', help: 'close a pooled backend this old (a changed password stops being honoured within it)' },
  poolKeepWarm: { group: 'pool', flag: 'pool-keep-warm', arg: 'duration', kind: 'ms', default: '1h', help: 'keep one backend logged in for each user and database used this recently, past --pool-idle-timeout (in transaction mode, its replacement logged in before --pool-max-lifetime ends it): no login after the first pays the link to Postgres (0: none)' },
  noPool: { group: 'pool', flag: 'no-pool', kind: 'switch', help: 'no warm backends: every session and /sql request logs in on a connection of its own' },
  noAuthOffload: { group: 'pool', flag: 'no-auth-offload', kind: 'switch', help: 'relay the startup untouched: clients authenticate with Postgres end to end' },
  jwksUrl: { group: 'tokens', flag: 'jwks-url', arg: 'url', kind: 'text', help: "the issuer's JWKS (RS/PS/ES/EdDSA keys), refetched for an unknown kid" },
  jwtSecretFile: { group: 'tokens', flag: 'jwt-secret-file', arg: 'file', kind: 'file', help: 'or an HS256/384/512 secret (at least 32 bytes), instead of --jwks-url' },
  jwtAudience: { group: 'tokens', flag: 'jwt-audience', arg: 'aud', kind: 'text', help: "the audience (aud) a token must be for (required with tokens)" },
  jwtIssuer: { group: 'tokens', flag: 'jwt-issuer', arg: 'iss', kind: 'text', help: 'the issuer (iss) a token must come from' },
  jwtRoles: { group: 'tokens', flag: 'jwt-roles', arg: 'role,...', kind: 'list', help: 'the Postgres roles a token may name (each a login role with a password in --passfile); comma-separated or repeated' },
  jwtRoleClaim: { group: 'tokens', flag: 'jwt-role-claim', arg: 'name', kind: 'text', default: 'role', help: 'the claim that names the role' },
  listenPolicy: { group: 'tokens', flag: 'listen-policy', arg: 'schema.function', kind: 'text', help: "transaction mode: a function (channel text) returning boolean, run as the token's role with its claims (edgepg.claims()), that says whether a token session may LISTEN on a channel; without it, token sessions may not" },
  passfile: { group: 'tokens', flag: 'passfile', arg: 'file', kind: 'path', help: "pgpass-format file with the roles' passwords (default PGPASSFILE, else ~/.pgpass)" },
  replica: { group: 'replicas', flag: 'replica', arg: 'host:port', kind: 'addresses', help: "a hot standby of --upstream (repeatable; env: comma-separated): transaction mode sends it transactions begun read-only and autocommit reads, each once it has replayed what its session has seen (sessions by token stay on the primary)" },
  replicaMaxLag: { group: 'replicas', flag: 'replica-max-lag', arg: 'duration', kind: 'ms', default: '5s', help: 'pass over a replica whose replay lags more than this; its reads go to another, or the primary' },
  replicaWait: { group: 'replicas', flag: 'replica-wait', arg: 'duration', kind: 'ms', default: '200ms', help: 'longest a read waits for a replica to replay what its session has written or seen, then it runs on the primary' },
  noReplicaAutocommit: { group: 'replicas', flag: 'no-replica-autocommit', kind: 'switch', help: 'send replicas only transactions begun read-only (BEGIN READ ONLY, or default_transaction_read_only), not autocommit reads' },
  sqlMaxBody: { group: 'sql', flag: 'sql-max-body', arg: 'size', kind: 'bytes', default: '10MiB', help: 'largest request body (HTTP 413)' },
  sqlMaxResponse: { group: 'sql', flag: 'sql-max-response', arg: 'size', kind: 'bytes', default: '10MiB', help: 'largest response (HTTP 507)' },
  sqlStatementTimeout: { group: 'sql', flag: 'sql-statement-timeout', arg: 'duration', kind: 'ms', default: '1m', help: 'statement timeout (0: none)' },
  sqlMaxRequests: { group: 'sql', flag: 'sql-max-requests', arg: 'n', kind: 'count', default: '500', help: 'requests at once; more get HTTP 503' },
  sqlMaxRequestsPerIp: { group: 'sql', flag: 'sql-max-requests-per-ip', arg: 'n', kind: 'count', default: '50', help: 'requests at once from one client address; more get HTTP 429' },
  sqlReadTimeout: { group: 'sql', flag: 'sql-read-timeout', arg: 'duration', kind: 'ms', default: '10s', help: 'time a client has to send its whole request body (HTTP 408)' },
  noSql: { group: 'sql', flag: 'no-sql', kind: 'switch', help: 'turn off POST /sql' },
  logLevel: { group: 'observability', flag: 'log-level', arg: 'level', kind: 'choice', default: 'info', help: "the log's weight (stdout, a JSON object a line): info, every session and /sql request and the proxy's own events (listening, shutdown, reload); warn, only sessions and requests that did not end well (refused, failed, timed out) and the proxy's events; error, only what failed (a certificate that did not reload). The line saying where it listens is written at every level" },
  adminListen: { group: 'observability', flag: 'admin-listen', arg: '[host:]port', kind: 'listen', help: 'serve /metrics and /healthz here only, not on --listen (keep it off the internet); without it, --listen serves /metrics to this machine only' },
  trustProxy: { group: 'observability', flag: 'trust-proxy', arg: 'cidr', kind: 'list', help: "a load balancer's address range: from it, take the client's address from the PROXY protocol or X-Forwarded-For (repeatable)" },
} satisfies Record<string, Setting>

/** A flag's environment variable. */
export const envOf = (flag: string) => `EDGEPG_${flag.toUpperCase().replace(/-/g, '_')}`

export const SETTINGS = Object.fromEntries(Object.entries(TABLE).map(([key, s]) => [key, { ...s, env: envOf(s.flag) }])) as {
  [K in keyof typeof TABLE]: (typeof TABLE)[K] & { env: string }
}

export type Key = keyof typeof SETTINGS
export type Entry = Setting & { env: string }

/** A setting as --help and the reference name it: `--pool-timeout duration`. */
export const flagOf = (s: Setting) => `--${s.flag}${s.arg ? ` ${s.arg}` : ''}`

/** Each option and what it does, the texts in one column past the longest option, wrapped at `columns`. */
function helpLines(lines: Array<[string, string]>, width: number, columns = 100): string {
  return lines.map(([head, text]) => `  ${head.padEnd(width - 2)}${wrap(text, columns - width).join(`\n${' '.repeat(width)}`)}`).join('\n')
}

/** `text`'s words in lines of at most `room` characters (a longer word on a line of its own). */
export function wrap(text: string, room: number): string[] {
  const out = ['']
  for (const word of text.split(' ')) {
    const last = out.length - 1
    if (out[last] && out[last].length + 1 + word.length > room) out.push(word)
    else out[last] += (out[last] ? ' ' : '') + word
  }
  return out
}

const entries = Object.values(SETTINGS) as Entry[]
const width = Math.max(...entries.map((s) => flagOf(s).length)) + 4

export const HELP = `edgepg-proxy: relays WebSocket connections from edgepg (or @neondatabase/serverless) to Postgres.

Usage: edgepg-proxy --upstream host:port [--listen [host:]port] [options]
       edgepg-proxy setup-auth <database-url> [--neon-compat]   what a database needs for tokens
       edgepg-proxy token --role <role> [--claim name=value ...] [--ttl duration]
                                                               a test token, signed with --jwt-secret-file

Each option is also read from the environment variable EDGEPG_ and its name (--pool-size:
EDGEPG_POOL_SIZE; switches take true or false there, lists are comma-separated). Durations are in
ms or take a unit (500ms, 5s, 2m, 1h), sizes in bytes or take one (64KiB, 64MiB, 10MB).
${(Object.keys(GROUPS) as Array<keyof typeof GROUPS>)
  .map((g) => `\n${GROUPS[g]}:\n${helpLines(entries.filter((s) => s.group === g).map((s) => [flagOf(s), `${s.help}${s.default ? ` (default ${s.default})` : ''}`]), width)}`)
  .join('\n')}

${helpLines([['-h, --help', 'show this help']], width)}

Routes: /v2 relays to the upstream. A client naming an address (?address=host:port on /v1 or /v2,
the connection string's host on /sql) goes there if it is the upstream or an --allow entry, to the
upstream if it names the proxy's own host (or a loopback name, for an upstream on this machine) at
the upstream's port, and is refused with HTTP 403 otherwise. Never an open relay.
POST /sql speaks Neon's SQL-over-HTTP protocol (edgepg's httpSql; neon() with fetchEndpoint
https://<proxy>/sql). GET /healthz checks the upstream is reachable; GET /metrics serves metrics
(on --listen, to this machine only).
Logs one JSON line per session (peer, upstream, duration, bytes, outcome) to stdout.
Signals: SIGTERM/SIGINT shut down gracefully; SIGHUP reloads --cert and --key; SIGUSR2 (with a
primary, --workers 2 or more) replaces the workers one at a time from the code on disk, refusing no one.
`

export const TOKEN_USAGE = `Usage: edgepg-proxy token --role <role> [--claim name=value ...] [--claim name:=<json> ...] [--ttl duration]
  Signs a token for trying tokens out with the proxy's --jwt-secret-file (HS256), for its
  --jwt-audience and --jwt-issuer, naming <role> in its --jwt-role-claim; --ttl (default 1h) sets
  when it expires. Those settings are read as the proxy reads them, from flags or EDGEPG_ variables.`
