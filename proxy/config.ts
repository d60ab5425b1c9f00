import { readFileSync } from 'node:fs'
import { isIP, isIPv6 } from 'node:net'
import { availableParallelism } from 'node:os'
import { parseArgs } from 'node:util'
import { parseHostPort, type HostPort } from './upstream/address'
import type { ProxyOptions } from './index'
import type { TokenLoginOptions } from './auth/token-login'
import type { Mint } from './auth/mint'
import { policyName } from './notify/policy'
import { SETTINGS, envOf, type Entry, type Key, type Setting } from './settings'

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
  for (const gone of Object.keys(REPLACED)) if (env[envOf(gone)]) throw new ConfigError(`${envOf(gone)} was replaced by ${REPLACED[gone]}`)
  for (const [old, now] of Object.entries(RENAMED)) if (env[old]) throw new ConfigError(`${old} is now ${now}: every variable is EDGEPG_ and its flag's name`)
  const read = reader(flags, env)
  const { raw, value, list, on } = read

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
  const tokens = tokenOptions(read, env)

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
        listenBufferBytes: value('listenBuffer', number(1)),
        listenPolicy: value('listenPolicy', (t, s) => {
          if (!policyName(t)) throw new ConfigError(`${s} must name a function as schema.function, not "${t}"`)
          return t
        }),
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

/** A setting's text from its flag, else its environment variable, else its default; and readings of it. */
function reader(flags: Flags, env: NodeJS.ProcessEnv) {
  const raw = (key: Key): { text?: string; texts?: string[]; source: string } => {
    const s: Entry = SETTINGS[key]
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
  const on = (key: Key) => {
    const s: Entry = SETTINGS[key]
    if (flags[s.flag]) return true
    const text = env[s.env]?.toLowerCase()
    if (!text) return false
    if (!['true', 'false', '1', '0'].includes(text)) throw new ConfigError(`${s.env} must be true or false, got "${env[s.env]}"`)
    return text === 'true' || text === '1'
  }
  return { raw, value, list, on }
}

function address(text: string, source: string, defaultPort?: number) {
  try {
    return parseHostPort(text, defaultPort)
  } catch (err) {
    throw new ConfigError(`${source}: ${(err as Error).message}`)
  }
}

/** A count; a duration (ms, or with a unit) or a size (bytes, or with a unit), as the setting's kind says. */
const number = (min: number) => (text: string, source: string, kind?: Setting['kind']) => {
  const n = kind === 'ms' || kind === 'bytes' ? withUnit(text, UNITS[kind]) : /^\d+$/.test(text.trim()) ? Number(text) : NaN
  if (!(n >= min)) throw new ConfigError(`${source} must be ${WANTED[kind === 'ms' || kind === 'bytes' ? kind : 'count']} ≥ ${min}, got "${text}"`)
  return n
}

function file(text: string, source: string) {
  try {
    return readFileSync(text)
  } catch (err) {
    throw new ConfigError(`${source}: cannot read "${text}": ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`)
  }
}

/** `edgepg-proxy token …`'s arguments, with the proxy's token settings from flags or the environment. */
export function parseTokenCommand(argv: string[], env: NodeJS.ProcessEnv): Mint | 'help' {
  const flags = parseFlags(argv, { role: { type: 'string' }, claim: { type: 'string', multiple: true }, ttl: { type: 'string' } })
  if (flags.help) return 'help'
  const read = reader(flags, env)
  const { raw, list } = read
  if (raw('jwksUrl').text) throw new ConfigError('token signs with --jwt-secret-file; with --jwks-url, tokens come from your issuer')
  const secret = secretOf(read)
  if (!secret) throw new ConfigError('token needs --jwt-secret-file (or EDGEPG_JWT_SECRET_FILE): the secret the proxy checks tokens with')
  const audience = raw('jwtAudience').text
  if (!audience) throw new ConfigError('token needs --jwt-audience (or EDGEPG_JWT_AUDIENCE): the audience the proxy checks')
  const role = flags.role
  if (typeof role !== 'string' || !role) throw new ConfigError('token needs --role: the Postgres role the token names')
  const roles = list('jwtRoles')
  if (roles.length && !roles.includes(role)) throw new ConfigError(`--role ${role} is not one of --jwt-roles (${roles.join(', ')}): the proxy would refuse the token`)
  const claims: Record<string, unknown> = {}
  for (const c of (flags.claim as string[] | undefined) ?? []) {
    const m = /^([^=:]+)(:?=)(.*)$/s.exec(c)
    if (!m) throw new ConfigError(`--claim ${c}: write name=value, or name:=<json> for a number, boolean or object`)
    try {
      claims[m[1]] = m[2] === '=' ? m[3] : JSON.parse(m[3])
    } catch {
      throw new ConfigError(`--claim ${c}: after := goes JSON (42, true, "text", {"a":1})`)
    }
  }
  const ttlMs = number(1000)(typeof flags.ttl === 'string' ? flags.ttl : '1h', '--ttl', 'ms')
  return { secret, audience, issuer: raw('jwtIssuer').text, roleClaim: raw('jwtRoleClaim').text!, role, claims, ttlSeconds: Math.round(ttlMs / 1000) }
}

/** The token settings (--jwks-url or --jwt-secret-file, and what goes with them), if any are given. */
function tokenOptions(read: ReturnType<typeof reader>, env: NodeJS.ProcessEnv): TokenLoginOptions | undefined {
  const { raw, list } = read
  const jwksUrl = raw('jwksUrl').text
  const secret = secretOf(read)
  if (!jwksUrl && !secret) return undefined
  if (jwksUrl && secret) throw new ConfigError('--jwks-url and --jwt-secret-file: give one of them')
  if (jwksUrl && !/^https?:\/\//.test(jwksUrl)) throw new ConfigError(`--jwks-url must be an http(s):// URL, got "${jwksUrl}"`)
  const roles = list('jwtRoles')
  if (!roles.length) throw new ConfigError('tokens need --jwt-roles: the Postgres roles a token may name')
  const audience = raw('jwtAudience').text
  if (!audience) throw new ConfigError('tokens need --jwt-audience: the audience (aud) tokens for this proxy carry')
  return { jwksUrl, secret, audience, issuer: raw('jwtIssuer').text, roles, roleClaim: raw('jwtRoleClaim').text, passfile: raw('passfile').text ?? env.PGPASSFILE }
}

/** --jwt-secret-file's secret (see secretBytes), if given: at least 32 bytes. */
function secretOf({ value }: ReturnType<typeof reader>): Buffer | undefined {
  const key = value('jwtSecretFile', (text, source) => secretBytes(file(text, source)))
  if (key && key.length < 32) throw new ConfigError(`--jwt-secret-file: the secret must be at least 32 bytes, got ${key.length}`)
  return key
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
/** Environment variables renamed to the one rule, and their names now. */
const RENAMED: Record<string, string> = { EDGEPG_REPLICAS: 'EDGEPG_REPLICA (--replica)' }

type Flags = Record<string, string | string[] | boolean | undefined>

type FlagOptions = Record<string, { type: 'string' | 'boolean'; multiple?: boolean; short?: string }>

function parseFlags(argv: string[], extra: FlagOptions = {}): Flags {
  const options: FlagOptions = { help: { type: 'boolean', short: 'h' }, ...extra }
  for (const s of Object.values(SETTINGS) as Setting[]) {
    options[s.flag] = { type: s.kind === 'switch' ? 'boolean' : 'string', multiple: s.kind === 'addresses' || s.kind === 'list' }
  }
  for (const arg of argv) {
    const gone = /^--([a-z-]+)/.exec(arg)?.[1]
    if (gone && REPLACED[gone]) throw new ConfigError(`--${gone} was replaced by ${REPLACED[gone]}`)
  }
  try {
    return parseArgs({ args: argv, options, strict: true }).values as Flags
  } catch (err) {
    const unknown = (err as NodeJS.ErrnoException).code === 'ERR_PARSE_ARGS_UNKNOWN_OPTION' && argv.map((a) => /^--([^=]+)/.exec(a)?.[1]).find((f) => f && !(f in options))
    if (!unknown) throw new ConfigError((err as Error).message)
    const near = closest(unknown, Object.keys(options))
    throw new ConfigError(`unknown option --${unknown}${near ? `; did you mean --${near}?` : ''}`)
  }
}
