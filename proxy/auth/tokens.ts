/**
 * Signed tokens in place of database passwords: a JWT, verified with jose against the operator's
 * JWKS (or an HS256 secret), names through its role claim one of the Postgres roles the operator
 * listed. The proxy then logs in as that role with the password from its passfile, and hands
 * Postgres the token's claims (proxy/auth/claims.ts). Nothing of the token itself reaches Postgres
 * or a log.
 */
import { createRemoteJWKSet, customFetch, errors, jwtVerify, type FetchImplementation, type JWTPayload, type JWTVerifyGetKey } from 'jose'

export interface TokenOptions {
  /** An issuer's JWKS (asymmetric keys), fetched, cached, and fetched again for an unknown `kid`. */
  jwksUrl?: string
  /** Or a shared secret (HS256, HS384, HS512). */
  secret?: Uint8Array
  audience?: string
  issuer?: string
  /** The Postgres roles a token may name. */
  roles: string[]
  /** The claim that names the role (default `role`). */
  roleClaim?: string
  /** Leeway for exp and nbf, in seconds (default 5). */
  leewaySeconds?: number
  /** Least time between two fetches of the JWKS, for a kid it lacks (default 30 s): a flood of made-up kids costs the issuer nothing. */
  jwksCooldownMs?: number
  /** Least time between two fetches of the JWKS while the issuer fails (default 5 s, or the cooldown if shorter). */
  jwksRetryMs?: number
}

/** A verified token: the role it names, its claims as JSON text, and when it expires, leeway included (ms since the epoch). */
export interface Identity {
  role: string
  claims: string
  expiresAt: number
}

/** A token refused: SQLSTATE 28000 (28P01 for one whose signature does not verify), and what failed. */
export class TokenRefused extends Error {
  constructor(message: string, readonly code = '28000') {
    super(message)
  }
}

const ASYMMETRIC = ['RS256', 'RS384', 'RS512', 'PS256', 'PS384', 'PS512', 'ES256', 'ES384', 'ES512', 'EdDSA', 'Ed25519']
const SYMMETRIC = ['HS256', 'HS384', 'HS512']
/** Longest token accepted, in characters (a JWT with a few claims is under 1 KiB). */
const MAX_TOKEN_CHARS = 8192
/** Latest exp accepted, in seconds: the end of the year 9999. Beyond it is no time a session can last, and in milliseconds any exp of today. */
const MAX_EXP = 253_402_300_799
/** Largest JWKS accepted, in bytes, and most keys (an issuer lists a few; 100 RSA-4096 keys are ~80 KiB). */
const MAX_JWKS_BYTES = 1 << 20
const MAX_JWKS_KEYS = 100

/** The issuer's JWKS could not be had (not a refusal of the token: it was not checked). */
class JwksUnavailable extends Error {}

export class Tokens {
  private readonly key: JWTVerifyGetKey | Uint8Array
  private readonly algorithms: string[]
  private readonly roles: Set<string>
  private readonly roleClaim: string
  private readonly leeway: number

  constructor(private readonly o: TokenOptions) {
    if (!o.jwksUrl === !o.secret) throw new Error('tokens: give a JWKS URL or a secret, one of them')
    if (!o.roles.length) throw new Error('tokens: no roles a token may name (--jwt-roles)')
    // A JWKS is fetched again for a kid it lacks (key rotation), but not within the cooldown of the last fetch.
    const cooldown = o.jwksCooldownMs ?? 30_000
    this.key = o.jwksUrl
      ? createRemoteJWKSet(new URL(o.jwksUrl), { cooldownDuration: cooldown, cacheMaxAge: 600_000, timeoutDuration: 5000, [customFetch]: jwksFetch(o.jwksRetryMs ?? Math.min(cooldown, 5000)) })
      : o.secret!
    this.algorithms = o.jwksUrl ? ASYMMETRIC : SYMMETRIC
    this.roles = new Set(o.roles)
    this.roleClaim = o.roleClaim ?? 'role'
    this.leeway = o.leewaySeconds ?? 5
  }

  /** The identity `token` proves, or TokenRefused saying which check failed (never quoting the token). */
  async verify(token: string): Promise<Identity> {
    if (token.length > MAX_TOKEN_CHARS) throw new TokenRefused(`token refused: longer than ${MAX_TOKEN_CHARS} characters`)
    let payload: JWTPayload
    try {
      ;({ payload } = await jwtVerify(token, this.key as JWTVerifyGetKey, {
        algorithms: this.algorithms,
        audience: this.o.audience,
        issuer: this.o.issuer,
        clockTolerance: this.leeway,
        requiredClaims: ['exp'],
      }))
    } catch (err) {
      throw refusal(err)
    }
    if (typeof payload.exp !== 'number' || payload.exp > MAX_EXP) throw new TokenRefused(`token refused: its exp (${payload.exp}) is past the year 9999: exp is in seconds since 1970, not milliseconds`)
    // Postgres's jsonb cannot hold a NUL: claims with one could never be set (and a backend would be lost trying).
    const claims = JSON.stringify(payload, (key, value) => {
      if (key.includes('\0') || (typeof value === 'string' && value.includes('\0'))) throw new TokenRefused('token refused: its claims hold a NUL character (\\u0000), which Postgres cannot store')
      return value
    })
    const role = payload[this.roleClaim]
    if (role === undefined) throw new TokenRefused(`token refused: it has no "${this.roleClaim}" claim naming a database role`)
    if (typeof role !== 'string' || !this.roles.has(role)) throw new TokenRefused(`token refused: role ${JSON.stringify(role)} is not one a token may use`)
    // (A session ends at exp; with the leeway its verification had, so that one is never let in only to be ended.)
    return { role, claims, expiresAt: (payload.exp + this.leeway) * 1000 }
  }
}

/** jose's error, as the check that failed. */
function refusal(err: unknown): TokenRefused {
  const e = err as errors.JOSEError
  if (e instanceof errors.JWTExpired) return new TokenRefused(`token refused: expired at ${at(e.payload.exp)}`)
  if (e instanceof errors.JWTClaimValidationFailed) {
    if (e.claim === 'nbf') return new TokenRefused(`token refused: not valid before ${at(e.payload.nbf)}`)
    if (e.claim === 'aud') return new TokenRefused('token refused: not for this audience (aud)')
    if (e.claim === 'iss') return new TokenRefused('token refused: not from the expected issuer (iss)')
    if (e.claim === 'exp') return new TokenRefused(e.reason === 'missing' ? 'token refused: it has no expiry (exp)' : 'token refused: its exp is not a number')
    return new TokenRefused(`token refused: claim ${e.claim} is invalid (${e.reason})`)
  }
  if (e instanceof errors.JWSSignatureVerificationFailed) return new TokenRefused('token refused: its signature does not verify', '28P01')
  if (e instanceof errors.JOSEAlgNotAllowed) return new TokenRefused('token refused: its algorithm is not allowed')
  if (e instanceof errors.JWKSNoMatchingKey) return new TokenRefused('token refused: signed with a key the issuer does not list (kid)', '28P01')
  if (e instanceof JwksUnavailable || e instanceof errors.JWKSTimeout || e instanceof errors.JWKSInvalid || !(e instanceof errors.JOSEError)) {
    return new TokenRefused(`token not checked: the issuer's keys (JWKS) could not be fetched (${(err as Error)?.message ?? err})`, '08001')
  }
  return new TokenRefused('token refused: malformed')
}

const at = (seconds: unknown) => (typeof seconds === 'number' ? new Date(seconds * 1000).toISOString() : 'an invalid time')

/**
 * jose's fetch of the JWKS, bounded: at most MAX_JWKS_BYTES and MAX_JWKS_KEYS, and while the issuer
 * fails, no more than one fetch per `retryMs` (jose's cooldown only follows a fetch that succeeded:
 * a flood of unknown kids would each fetch again). Whatever fails is JwksUnavailable.
 */
function jwksFetch(retryMs: number): FetchImplementation {
  let failed: { at: number; why: string } | undefined
  return async (url, options) => {
    if (failed && performance.now() - failed.at < retryMs) throw new JwksUnavailable(`${failed.why}; tried again within ${retryMs} ms`)
    try {
      const res = await fetch(url, options)
      if (res.status !== 200) throw new JwksUnavailable(`HTTP ${res.status}`)
      const text = await boundedText(res, MAX_JWKS_BYTES)
      let keys: unknown
      try {
        keys = JSON.parse(text).keys
      } catch {
        throw new JwksUnavailable('not JSON')
      }
      if (Array.isArray(keys) && keys.length > MAX_JWKS_KEYS) throw new JwksUnavailable(`${keys.length} keys; at most ${MAX_JWKS_KEYS} are taken`)
      failed = undefined
      return new Response(text, { status: 200 })
    } catch (err) {
      const why = err instanceof JwksUnavailable ? err.message : (err as Error).name === 'TimeoutError' ? 'timed out' : (err as Error).message
      failed = { at: performance.now(), why }
      throw err instanceof JwksUnavailable ? err : new JwksUnavailable(why)
    }
  }
}

/** A response's body as text, read no further than `max` bytes. */
async function boundedText(res: Response, max: number): Promise<string> {
  const tooLarge = () => new JwksUnavailable(`larger than ${max} bytes`)
  if (Number(res.headers.get('content-length')) > max) {
    await res.body?.cancel()
    throw tooLarge()
  }
  const chunks: Uint8Array[] = []
  let size = 0
  const reader = res.body?.getReader()
  for (;;) {
    const read = await reader?.read()
    if (!read || read.done) break
    if ((size += read.value.length) > max) {
      await reader!.cancel()
      throw tooLarge()
    }
    chunks.push(read.value)
  }
  return Buffer.concat(chunks).toString('utf8')
}
