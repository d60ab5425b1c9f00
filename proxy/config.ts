import { readFileSync } from 'node:fs'
import { isIP, isIPv6 } from 'node:net'
import { availableParallelism } from 'node:os'
import { parseArgs } from 'node:util'
import { parseHostPort, type HostPort } from './upstream/address'
import type { ProxyOptions } from './index'
import type { TokenLoginOptions } from './auth/token-login'

/**
 * edgepg-proxy's settings: one table gives each its flag, environment variable, default and help,
 * so parsing, validation and `--help` cannot drift apart.
 */
interface Setting {
  flag: string
  env: string
  arg?: string
  kind: 'address' | 'listen' | 'addresses' | 'list' | 'count' | 'ms' | 'bytes' | 'file' | 'path' | 'text' | 'sslmode' | 'choice' | 'switch'
  default?: string
  help: string
}

export const SETTINGS = {
  workers: { flag: 'workers', env: 'EDGEPG_WORKERS', arg: 'n', kind: 'count', default: 'cores', help: "processes accepting on the one port (cores: the machine's, at most --pool-size); limits hold for the proxy as a whole" },
  upstream: { flag: 'upstream', env: 'EDGEPG_UPSTREAM', arg: 'host:port', kind: 'address', help: 'Postgres to relay to (required)' },
  listen: { flag: 'listen', env: 'EDGEPG_LISTEN', arg: '[host:]port', kind: 'listen', default: '127.0.0.1:8080', help: 'where to accept WebSockets (0.0.0.0:PORT for remote clients)' },
  adminListen: { flag: 'admin-listen', env: 'EDGEPG_ADMIN_LISTEN', arg: '[host:]port', kind: 'listen', help: 'serve /metrics and /healthz here only, not on --listen (keep it off the internet); without it, --listen serves /metrics to this machine only' },
  allow: { flag: 'allow', env: 'EDGEPG_ALLOW', arg: 'host:port', kind: 'addresses', help: 'another upstream clients may name (?address= on /v1 and /v2, the connection string on /sql; repeatable; env: comma-separated)' },
  cert: { flag: 'cert', env: 'EDGEPG_CERT', arg: 'file', kind: 'file', help: 'TLS certificate chain (PEM): serve wss:// and https://; reloaded on SIGHUP' },
  key: { flag: 'key', env: 'EDGEPG_KEY', arg: 'file', kind: 'file', help: 'TLS private key (PEM), with --cert' },
  upstreamSslmode: { flag: 'upstream-sslmode', env: 'EDGEPG_UPSTREAM_SSLMODE', arg: 'mode', kind: 'sslmode', default: 'disable', help: 'TLS to Postgres: disable, require, verify-ca or verify-full' },
  upstreamCa: { flag: 'upstream-ca', env: 'EDGEPG_UPSTREAM_CA', arg: 'file', kind: 'file', help: "CA (PEM) for Postgres's certificate: for verify-ca / verify-full, and clients whose ssl verifies it" },
  allowOrigin: { flag: 'allow-origin', env: 'EDGEPG_ALLOW_ORIGIN', arg: 'origin', kind: 'list', help: 'browser Origin allowed to connect (repeatable; * for any); requests without Origin are always allowed' },
  maxSessions: { flag: 'max-sessions', env: 'EDGEPG_MAX_SESSIONS', arg: 'n', kind: 'count', default: '10000', help: 'concurrent sessions in all; more are refused with HTTP 503' },
  maxSessionsPerIp: { flag: 'max-sessions-per-ip', env: 'EDGEPG_MAX_SESSIONS_PER_IP', arg: 'n', kind: 'count', default: '100', help: 'concurrent sessions from one client address; more get HTTP 429' },
  handshakeTimeout: { flag: 'handshake-timeout', env: 'EDGEPG_HANDSHAKE_TIMEOUT', arg: 'ms', kind: 'ms', default: '10000', help: 'time a client has from connecting to finishing its Postgres startup' },
  idleTimeout: { flag: 'idle-timeout', env: 'EDGEPG_IDLE_TIMEOUT', arg: 'ms', kind: 'ms', default: '900000', help: 'close a session with no traffic either way for this long (0: never)' },
  maxMessageBytes: { flag: 'max-message-bytes', env: 'EDGEPG_MAX_MESSAGE_BYTES', arg: 'n', kind: 'bytes', default: '67108864', help: 'largest WebSocket message accepted from a logged-in client (before login: 64 KiB)' },
  maxClientBuffer: { flag: 'max-client-buffer', env: 'EDGEPG_MAX_CLIENT_BUFFER', arg: 'n', kind: 'bytes', default: '268435456', help: "bytes all clients' unfinished messages and /sql bodies may hold; a message that does not fit is refused (1009)" },
  maxLogins: { flag: 'max-logins', env: 'EDGEPG_MAX_LOGINS', arg: 'n', kind: 'count', default: '64', help: 'logins waiting on Postgres at once (connected, not yet accepted); more wait their turn' },
  maxLoginsPerIp: { flag: 'max-logins-per-ip', env: 'EDGEPG_MAX_LOGINS_PER_IP', arg: 'n', kind: 'count', default: '8', help: 'logins waiting on Postgres at once from one client address; more wait their turn' },
  maxCancelsPerIp: { flag: 'max-cancels-per-ip', env: 'EDGEPG_MAX_CANCELS_PER_IP', arg: 'n', kind: 'count', default: '20', help: 'CancelRequests a second from one client address; more are dropped' },
  logLevel: { flag: 'log-level', env: 'EDGEPG_LOG_LEVEL', arg: 'level', kind: 'choice', default: 'info', help: 'what the log (stdout, a JSON object a line) carries: info: every session and /sql request, and the proxy\'s own events (listening, shutdown, reload); warn: only sessions and requests that did not end well (refused, failed, timed out), and the proxy\'s events; error: only what failed (a certificate that did not reload); at every level, the line saying where it listens' },
  shutdownGrace: { flag: 'shutdown-grace', env: 'EDGEPG_SHUTDOWN_GRACE', arg: 'ms', kind: 'ms', default: '10000', help: 'on SIGTERM, time running sessions get to finish before close code 1001' },
  sqlMaxBody: { flag: 'sql-max-body', env: 'EDGEPG_SQL_MAX_BODY', arg: 'n', kind: 'bytes', default: '10485760', help: 'POST /sql: largest request body (HTTP 413)' },
  sqlMaxResponse: { flag: 'sql-max-response', env: 'EDGEPG_SQL_MAX_RESPONSE', arg: 'n', kind: 'bytes', default: '10485760', help: 'POST /sql: largest response (HTTP 507)' },
  sqlStatementTimeout: { flag: 'sql-statement-timeout', env: 'EDGEPG_SQL_STATEMENT_TIMEOUT', arg: 'ms', kind: 'ms', default: '60000', help: 'POST /sql: statement timeout (0: none)' },
  sqlMaxRequests: { flag: 'sql-max-requests', env: 'EDGEPG_SQL_MAX_REQUESTS', arg: 'n', kind: 'count', default: '500', help: 'POST /sql: requests at once; more get HTTP 503' },
  sqlMaxRequestsPerIp: { flag: 'sql-max-requests-per-ip', env: 'EDGEPG_SQL_MAX_REQUESTS_PER_IP', arg: 'n', kind: 'count', default: '50', help: 'POST /sql: requests at once from one client address; more get HTTP 429' },
  sqlReadTimeout: { flag: 'sql-read-timeout', env: 'EDGEPG_SQL_READ_TIMEOUT', arg: 'ms', kind: 'ms', default: '10000', help: 'POST /sql: time a client has to send its whole request body (HTTP 408)' },
  noPool: { flag: 'no-pool', env: 'EDGEPG_NO_POOL', kind: 'switch', help: 'no warm backends: every session and /sql request logs in on a connection of its own' },
  poolMaxBackends: { flag: 'pool-max-backends', env: 'EDGEPG_POOL_MAX_BACKENDS', arg: 'n', kind: 'count', default: '100', help: 'backends the pool owns in all (idle or lent): a login past it closes the idle one used longest ago, and with none idle gets a connection of its own' },
  poolMode: { flag: 'pool-mode', env: 'EDGEPG_POOL_MODE', arg: 'mode', kind: 'choice', default: 'transaction', help: 'session: a session holds its backend to its end; transaction: only while it runs something' },
  poolSize: { flag: 'pool-size', env: 'EDGEPG_POOL_SIZE', arg: 'n', kind: 'count', default: '20', help: 'backends per user, database and password: in transaction mode all, idle or lent; in session mode those kept idle (and /sql requests at once)' },
  poolTimeout: { flag: 'pool-timeout', env: 'EDGEPG_POOL_TIMEOUT', arg: 'ms', kind: 'ms', default: '5000', help: 'transaction mode: longest wait for a backend, then SQLSTATE 53300' },
  idleInTransactionTimeout: { flag: 'idle-in-transaction-timeout', env: 'EDGEPG_IDLE_IN_TRANSACTION_TIMEOUT', arg: 'ms', kind: 'ms', default: '60000', help: 'transaction mode: end a session idle inside a transaction this long, rolled back, as Postgres would (0: never)' },
  maxBackendsPerClient: { flag: 'max-backends-per-client', env: 'EDGEPG_MAX_BACKENDS_PER_CLIENT', arg: 'n', kind: 'count', default: 'a quarter of --pool-size', help: "transaction mode: a key's backends one client (a token's subject, else its address) holds while another client waits (alone it may hold all); the keys it keeps warm past --pool-idle-timeout (those it used last); and, while the pool is full, its connections outside it" },
  maxPinnedSessions: { flag: 'max-pinned-sessions', env: 'EDGEPG_MAX_PINNED_SESSIONS', arg: 'n', kind: 'count', default: 'a quarter of --pool-size', help: "transaction mode: a key's sessions kept on their backend for state they hold; one more is closed with 53400" },
  poolStatements: { flag: 'pool-statements', env: 'EDGEPG_POOL_STATEMENTS', arg: 'n', kind: 'count', default: '100', help: "transaction mode: named statements each backend keeps for its sessions" },
  poolIdleTimeout: { flag: 'pool-idle-timeout', env: 'EDGEPG_POOL_IDLE_TIMEOUT', arg: 'ms', kind: 'ms', default: '60000', help: "close a pooled backend idle this long (a key's last, used within --pool-keep-warm, is kept)" },
  poolMaxLifetime: { flag: 'pool-max-lifetime', env: 'EDGEPG_POOL_MAX_LIFETIME', arg: 'ms', kind: 'ms', default: '1800000', help: 'close a pooled backend this old (a changed password stops being honoured within it)' },
  poolKeepWarm: { flag: 'pool-keep-warm', env: 'EDGEPG_POOL_KEEP_WARM', arg: 'ms', kind: 'ms', default: '3600000', help: 'keep one backend logged in for each user and database used this recently, past --pool-idle-timeout (in transaction mode, its replacement logged in before --pool-max-lifetime ends it): no login after the first pays the link to Postgres (0: none)' },
  replica: { flag: 'replica', env: 'EDGEPG_REPLICAS', arg: 'host:port', kind: 'addresses', help: "a hot standby of --upstream (repeatable; env: comma-separated): transaction mode sends it transactions begun read-only and autocommit reads, each once it has replayed what its session has seen (sessions by token stay on the primary)" },
  replicaMaxLag: { flag: 'replica-max-lag', env: 'EDGEPG_REPLICA_MAX_LAG', arg: 'ms', kind: 'ms', default: '5000', help: 'pass over a replica whose replay lags more than this; its reads go to another, or the primary' },
  replicaWait: { flag: 'replica-wait', env: 'EDGEPG_REPLICA_WAIT', arg: 'ms', kind: 'ms', default: '200', help: 'longest a read waits for a replica to replay what its session has written or seen, then it runs on the primary' },
  noReplicaAutocommit: { flag: 'no-replica-autocommit', env: 'EDGEPG_NO_REPLICA_AUTOCOMMIT', kind: 'switch', help: 'send replicas only transactions begun read-only (BEGIN READ ONLY, or default_transaction_read_only), not autocommit reads' },
  noSql: { flag: 'no-sql', env: 'EDGEPG_NO_SQL', kind: 'switch', help: 'turn off POST /sql' },
  noAuthOffload: { flag: 'no-auth-offload', env: 'EDGEPG_NO_AUTH_OFFLOAD', kind: 'switch', help: 'relay the startup untouched: clients authenticate with Postgres end to end' },
  trustProxy: { flag: 'trust-proxy', env: 'EDGEPG_TRUST_PROXY', arg: 'cidr', kind: 'list', help: "a load balancer's address range: from it, take the client's address from the PROXY protocol or X-Forwarded-For (repeatable)" },
  jwksUrl: { flag: 'jwks-url', env: 'EDGEPG_JWKS_URL', arg: 'url', kind: 'text', help: "tokens: the issuer's JWKS (RS/PS/ES/EdDSA keys), refetched for an unknown kid" },
  jwtSecretFile: { flag: 'jwt-secret-file', env: 'EDGEPG_JWT_SECRET_FILE', arg: 'file', kind: 'file', help: 'tokens: or an HS256/384/512 secret (at least 32 bytes), instead of --jwks-url' },
  jwtAudience: { flag: 'jwt-audience', env: 'EDGEPG_JWT_AUDIENCE', arg: 'aud', kind: 'text', help: "tokens: the audience (aud) a token must be for (required with tokens)" },
  jwtIssuer: { flag: 'jwt-issuer', env: 'EDGEPG_JWT_ISSUER', arg: 'iss', kind: 'text', help: 'tokens: the issuer (iss) a token must come from' },
  jwtRoles: { flag: 'jwt-roles', env: 'EDGEPG_JWT_ROLES', arg: 'role,...', kind: 'list', help: 'tokens: the Postgres roles a token may name (each a login role with a password in --passfile); comma-separated or repeated' },
  jwtRoleClaim: { flag: 'jwt-role-claim', env: 'EDGEPG_JWT_ROLE_CLAIM', arg: 'name', kind: 'text', default: 'role', help: 'tokens: the claim that names the role' },
  passfile: { flag: 'passfile', env: 'EDGEPG_PASSFILE', arg: 'file', kind: 'path', help: "tokens: pgpass-format file with the roles' passwords (default PGPASSFILE, else ~/.pgpass)" },
  allowInsecurePasswords: { flag: 'allow-insecure-passwords', env: 'EDGEPG_ALLOW_INSECURE_PASSWORDS', kind: 'switch', help: 'accept passwords over plain ws:// from non-loopback clients (TLS ends in front)' },
} satisfies Record<string, Setting>

type Key = keyof typeof SETTINGS

/** Each option and what it does, the texts in one column past the longest option. */
function helpLines(lines: Array<[string, string]>): string {
  const width = Math.max(...lines.map(([head]) => head.length)) + 2
  return lines.map(([head, text]) => `  ${head.padEnd(width)}${text}`).join('\n')
}

export const HELP = `edgepg-proxy: relays WebSocket connections from edgepg (or @neondatabase/serverless) to Postgres.

Usage: edgepg-proxy --upstream host:port [--listen [host:]port] [options]
       edgepg-proxy setup-auth <database-url> [--neon-compat]   (what a database needs for tokens; see the README)

Options (each also settable by the environment variable shown; switches take true/false there;
durations in ms or with a unit: 500ms, 5s, 2m, 1h; sizes in bytes or with one: 64KiB, 64MiB, 10MB):
${helpLines([...(Object.values(SETTINGS) as Setting[]).map((s): [string, string] => [`--${s.flag}${s.arg ? ` ${s.arg}` : ''}`, `${s.help}${s.default ? ` (default ${s.default})` : ''}  [${s.env}]`]), ['-h, --help', 'show this help']])}

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

export class ConfigError extends Error {}

/** Log levels, lightest first. */
export const LOG_LEVELS = ['info', 'warn', 'error'] as const
export type LogLevel = (typeof LOG_LEVELS)[number]

export interface CliConfig {
  options: ProxyOptions
  /** --workers: processes accepting on the one port (proxy/cluster/). */
  workers: number
  listen: HostPort
  /** Where /metrics and /healthz are served instead of `listen`, if apart. */
  adminListen?: HostPort
  shutdownGraceMs: number
  /** --log-level: the least a log line must weigh to be written. */
  logLevel: LogLevel
  /** Rereads the certificate files (for SIGHUP); undefined without --cert. */
  readTls?: () => { cert: Buffer; key: Buffer }
}

/** Parses flags, then environment variables, then defaults; throws ConfigError naming the culprit. */
export function parseConfig(argv: string[], env: NodeJS.ProcessEnv): CliConfig | 'help' {
  const flags = parseFlags(argv)
  if (flags.help) return 'help'
  for (const gone of Object.keys(REPLACED)) {
    const variable = `EDGEPG_${gone.toUpperCase().replace(/-/g, '_')}`
    if (env[variable]) throw new ConfigError(`${variable} was replaced by ${REPLACED[gone]}`)
  }
  const raw = (key: Key): { text?: string; texts?: string[]; source: string } => {
    const s: Setting = SETTINGS[key]
    const given = flags[s.flag]
    if (given !== undefined) return { text: Array.isArray(given) ? undefined : String(given), texts: Array.isArray(given) ? given : undefined, source: `--${s.flag}` }
    const fromEnv = env[s.env]
    if (fromEnv !== undefined && fromEnv !== '') return { text: fromEnv, source: s.env }
    return { text: s.default, source: `--${s.flag}` }
  }
  const value = <T>(key: Key, read: (text: string, source: string, kind: Setting['kind']) => T): T | undefined => {
    const { text, source } = raw(key)
    return text === undefined ? undefined : read(text, source, SETTINGS[key].kind)
  }
  // Repeatable, and comma-separated (a flag's value as an environment variable's).
  const list = (key: Key): string[] => {
    const { text, texts } = raw(key)
    return (texts ?? (text ? [text] : [])).flatMap((t) => t.split(',')).map((t) => t.trim()).filter(Boolean)
  }
  const address = (text: string, source: string, defaultPort?: number) => {
    try {
      return parseHostPort(text, defaultPort)
    } catch (err) {
      throw new ConfigError(`${source}: ${(err as Error).message}`)
    }
  }
  // A count; a duration (ms, or with a unit) or a size (bytes, or with a unit), as the setting's kind says.
  const number = (min: number) => (text: string, source: string, kind?: Setting['kind']) => {
    const n = kind === 'ms' || kind === 'bytes' ? withUnit(text, UNITS[kind]) : /^\d+$/.test(text.trim()) ? Number(text) : NaN
    if (!(n >= min)) throw new ConfigError(`${source} must be ${WANTED[kind === 'ms' || kind === 'bytes' ? kind : 'count']} ≥ ${min}, got "${text}"`)
    return n
  }
  const file = (text: string, source: string) => {
    try {
      return readFileSync(text)
    } catch (err) {
      throw new ConfigError(`${source}: cannot read "${text}": ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`)
    }
  }
  const on = (key: Key) => {
    const s: Setting = SETTINGS[key]
    if (flags[s.flag]) return true
    const text = env[s.env]?.toLowerCase()
    if (!text) return false
    if (!['true', 'false', '1', '0'].includes(text)) throw new ConfigError(`${s.env} must be true or false, got "${env[s.env]}"`)
    return text === 'true' || text === '1'
  }

  const upstreamText = value('upstream', (t) => t)
  if (!upstreamText) throw new ConfigError('--upstream host:port is required (or set EDGEPG_UPSTREAM)')
  value('upstream', (t, s) => address(t, s))
  const allow = list('allow')
  for (const a of allow) address(a, raw('allow').source)
  const replicaAddresses = list('replica')
  for (const a of replicaAddresses) address(a, raw('replica').source)
  const listenAt = (t: string, s: string) => (/^\d+$/.test(t) ? address(`127.0.0.1:${t}`, s) : address(t, s, 8080))
  const listen = value('listen', listenAt)!
  const adminListen = value('adminListen', listenAt)

  const certPath = raw('cert').text
  const keyPath = raw('key').text
  if (!certPath !== !keyPath) throw new ConfigError('--cert and --key go together (or EDGEPG_CERT and EDGEPG_KEY)')
  const readTls = certPath && keyPath ? () => ({ cert: file(certPath, raw('cert').source), key: file(keyPath, raw('key').source) }) : undefined

  const sslmode = value('upstreamSslmode', (t, s) => {
    if (!['disable', 'require', 'verify-ca', 'verify-full'].includes(t)) throw new ConfigError(`${s} must be disable, require, verify-ca or verify-full, got "${t}"`)
    return t as 'disable' | 'require' | 'verify-ca' | 'verify-full'
  })!
  const ca = value('upstreamCa', file)
  if ((sslmode === 'verify-ca' || sslmode === 'verify-full') && !ca) throw new ConfigError(`--upstream-sslmode ${sslmode} needs --upstream-ca (the CA that signed Postgres's certificate)`)

  const trustProxy = list('trustProxy')
  for (const cidr of trustProxy) {
    const [address, bits] = cidr.split('/')
    const max = isIPv6(address) ? 128 : 32
    if (!isIP(address) || (bits !== undefined && !(/^\d+$/.test(bits) && Number(bits) <= max))) throw new ConfigError(`${raw('trustProxy').source}: "${cidr}" is not an address or a CIDR range (such as 10.0.0.0/8)`)
  }
  const jwksUrl = raw('jwksUrl').text
  const secret = value('jwtSecretFile', file)
  if (jwksUrl && secret) throw new ConfigError('--jwks-url and --jwt-secret-file: give one of them')
  let tokens: TokenLoginOptions | undefined
  if (jwksUrl || secret) {
    if (jwksUrl && !/^https?:\/\//.test(jwksUrl)) throw new ConfigError(`--jwks-url must be an http(s):// URL, got "${jwksUrl}"`)
    const key = secret && secretBytes(secret)
    if (key && key.length < 32) throw new ConfigError(`--jwt-secret-file: the secret must be at least 32 bytes, got ${key.length}`)
    const roles = list('jwtRoles')
    if (!roles.length) throw new ConfigError('tokens need --jwt-roles: the Postgres roles a token may name')
    const audience = raw('jwtAudience').text
    if (!audience) throw new ConfigError('tokens need --jwt-audience: the audience (aud) tokens for this proxy carry')
    tokens = { jwksUrl, secret: key || undefined, audience, issuer: raw('jwtIssuer').text, roles, roleClaim: raw('jwtRoleClaim').text, passfile: raw('passfile').text ?? env.PGPASSFILE }
  }

  const poolSize = value('poolSize', number(1))!
  // By default one worker per core, but no more than a key's backends can be split between.
  const workers = value('workers', (t, s) => (t === 'cores' ? Math.min(availableParallelism(), poolSize) : number(1)(t, s)))!
  if (workers > poolSize) throw new ConfigError(`--pool-size (${poolSize}) must be at least --workers (${workers}): each worker keeps its part of every key's backends`)

  return {
    workers,
    listen,
    adminListen,
    shutdownGraceMs: value('shutdownGrace', number(0))!,
    logLevel: value('logLevel', (t, s) => {
      if (!(LOG_LEVELS as readonly string[]).includes(t)) throw new ConfigError(`${s} must be one of ${LOG_LEVELS.join(', ')}, not "${t}"`)
      return t as LogLevel
    })!,
    readTls,
    options: {
      upstream: upstreamText,
      allow,
      adminApart: adminListen !== undefined,
      tls: readTls?.(),
      upstreamTls: sslmode === 'disable' && !ca ? undefined : { mode: sslmode, ca },
      allowedOrigins: list('allowOrigin'),
      maxSessions: value('maxSessions', number(1)),
      maxSessionsPerIp: value('maxSessionsPerIp', number(1)),
      handshakeTimeoutMs: value('handshakeTimeout', number(1)),
      idleTimeoutMs: value('idleTimeout', number(0)),
      maxMessageBytes: value('maxMessageBytes', number(1)),
      maxClientBufferBytes: value('maxClientBuffer', number(1)),
      maxLogins: value('maxLogins', number(1)),
      maxLoginsPerIp: value('maxLoginsPerIp', number(1)),
      maxCancelsPerIp: value('maxCancelsPerIp', number(1)),
      authOffload: !on('noAuthOffload'),
      pool: {
        enabled: !on('noPool'),
        maxBackends: value('poolMaxBackends', number(0)),
        idleTimeoutMs: value('poolIdleTimeout', number(1)),
        maxLifetimeMs: value('poolMaxLifetime', number(1)),
        keepWarmMs: value('poolKeepWarm', number(0)),
        mode: value('poolMode', (t, s) => {
          if (t !== 'session' && t !== 'transaction') throw new ConfigError(`${s} must be session or transaction, not "${t}"`)
          return t
        }),
        size: value('poolSize', number(1)),
        timeoutMs: value('poolTimeout', number(1)),
        statements: value('poolStatements', number(1)),
        idleInTransactionMs: value('idleInTransactionTimeout', number(0)),
        maxPerClient: value('maxBackendsPerClient', (t, s) => (t === SETTINGS.maxBackendsPerClient.default ? undefined : number(1)(t, s))),
        maxPinned: value('maxPinnedSessions', (t, s) => (t === SETTINGS.maxPinnedSessions.default ? undefined : number(1)(t, s))),
      },
      sql: on('noSql')
        ? false
        : {
            maxBodyBytes: value('sqlMaxBody', number(1)),
            maxResponseBytes: value('sqlMaxResponse', number(1)),
            statementTimeoutMs: value('sqlStatementTimeout', number(0)),
            maxRequests: value('sqlMaxRequests', number(1)),
            maxRequestsPerIp: value('sqlMaxRequestsPerIp', number(1)),
            readTimeoutMs: value('sqlReadTimeout', number(1)),
          },
      allowInsecurePasswords: on('allowInsecurePasswords'),
      tokens,
      replicas: replicaAddresses.length
        ? { addresses: replicaAddresses, maxLagMs: value('replicaMaxLag', number(0))!, waitMs: value('replicaWait', number(0))!, autocommit: !on('noReplicaAutocommit') }
        : undefined,
      trustProxy: trustProxy.length ? trustProxy : undefined,
    },
  }
}

/**
 * A --jwt-secret-file's secret: text (valid UTF-8 with no control characters once trimmed, as
 * `echo secret > file` writes it) is its trimmed text's bytes; anything else (`head -c 32 /dev/urandom`)
 * is its bytes as they are.
 */
export function secretBytes(file: Buffer): Buffer {
  let text: string
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(file).trim()
  } catch {
    return file
  }
  return /[\x00-\x1f\x7f-\x9f]/.test(text) ? file : Buffer.from(text)
}

/** What a duration's and a size's units are worth, in ms and bytes (a bare number is in those). */
const UNITS = {
  ms: { ms: 1, s: 1000, m: 60_000, h: 3_600_000 },
  bytes: { b: 1, kb: 1e3, mb: 1e6, gb: 1e9, kib: 1 << 10, mib: 1 << 20, gib: 1 << 30 },
} as const
const WANTED = { count: 'an integer', ms: 'a duration in ms or with a unit (500ms, 5s, 2m, 1h)', bytes: 'a size in bytes or with a unit (64KiB, 64MiB, 1GiB, 10MB)' }

/** `5s`, `64MiB`, `1.5GB` or a bare integer, by `units` (case aside): a whole number, else NaN. */
function withUnit(text: string, units: Record<string, number>): number {
  const m = /^(\d+(?:\.\d+)?)\s*([a-z]*)$/i.exec(text.trim())
  const unit = m && (m[2] ? units[m[2].toLowerCase()] : 1)
  if (!m || !unit || (!m[2] && m[1].includes('.'))) return NaN
  return Math.round(Number(m[1]) * unit)
}

/** The known option closest to an unknown one (a typo's few letters off, or a prefix), if any. */
function closest(unknown: string, known: string[]): string | undefined {
  const distance = (a: string, b: string) => {
    let row = Array.from({ length: b.length + 1 }, (_, j) => j)
    for (let i = 1; i <= a.length; i++) {
      const next = [i]
      for (let j = 1; j <= b.length; j++) next[j] = Math.min(row[j] + 1, next[j - 1] + 1, row[j - 1] + (a[i - 1] === b[j - 1] ? 0 : 1))
      row = next
    }
    return row[b.length]
  }
  const [best] = known.map((k) => ({ k, d: k.startsWith(unknown) ? 0 : distance(unknown, k) })).sort((x, y) => x.d - y.d)
  return best && best.d <= Math.max(2, Math.floor(unknown.length / 4)) ? best.k : undefined
}

/** Settings that are gone, and what took their place. */
const REPLACED: Record<string, string> = {
  'sql-pool-max': '--pool-size (EDGEPG_POOL_SIZE), which now bounds the backends /sql requests use per key',
  'pool-max-idle-per-key': '--pool-size (EDGEPG_POOL_SIZE), which now bounds the idle backends kept per key',
}

function parseFlags(argv: string[]): Record<string, string | string[] | boolean | undefined> {
  const options: Record<string, { type: 'string' | 'boolean'; multiple?: boolean; short?: string }> = { help: { type: 'boolean', short: 'h' } }
  for (const s of Object.values(SETTINGS) as Setting[]) {
    options[s.flag] = { type: s.kind === 'switch' ? 'boolean' : 'string', multiple: s.kind === 'addresses' || s.kind === 'list' }
  }
  for (const arg of argv) {
    const gone = /^--([a-z-]+)/.exec(arg)?.[1]
    if (gone && REPLACED[gone]) throw new ConfigError(`--${gone} was replaced by ${REPLACED[gone]}`)
  }
  try {
    return parseArgs({ args: argv, options, strict: true }).values as Record<string, string | string[] | boolean | undefined>
  } catch (err) {
    const unknown = (err as NodeJS.ErrnoException).code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION' && argv.map((a) => /^--([^=]+)/.exec(a)?.[1]).find((f) => f && !(f in options))
    if (!unknown) throw new ConfigError((err as Error).message)
    const near = closest(unknown, Object.keys(options))
    throw new ConfigError(`unknown option --${unknown}${near ? `; did you mean --${near}?` : ''}`)
  }
}
