/**
 * A token's claims, handed to Postgres so that the session cannot change them (see `edgepg
 * setup-auth`, proxy/auth/setup.ts). Each backend gets a random key of its own when the proxy first
 * uses it for tokens (edgepg.init, once: Postgres refuses it again for that backend). Before each
 * session or lend the proxy calls edgepg.set_claims(n, claims, mac), where n counts up per backend
 * and mac = HMAC-SHA256(key, "n:claims"): the function checks both, so a call made up or replayed
 * by a client fails, and stores the claims where only edgepg.claims() reads them. The key and MAC
 * travel as bind parameters: no query text, pg_stat_activity included, shows them.
 *
 * Claims are set before anything of the session's runs on the backend, and the session waits for
 * Postgres's answer: a backend whose claims could not be set serves no one.
 */
import { createHmac, randomBytes } from 'node:crypto'
import { serialize } from 'pg-protocol'
import type { Upstream } from '../upstream/connection'
import { exchange } from '../upstream/exchange'

/** What the proxy knows of a backend it set claims on: its key, and the last n it used. */
interface Keyed {
  key: Buffer
  n: number
}
const keyed = new WeakMap<Upstream, Keyed>()

const INIT = 'SELECT edgepg.init($1)'
const SET = 'SELECT edgepg.set_claims($1, $2, $3)'
const REPLICA_KEY = 'SELECT edgepg.replica_key($1, $2)'
const SET_ON_REPLICA = 'SELECT edgepg.set_replica_claims($1, $2)'
const SYNC = serialize.sync()
const EXECUTE = serialize.execute({})

export class ClaimsError extends Error {
  constructor(message: string, readonly code: string) {
    super(message)
  }
}

const hex = (b: Buffer) => `\\x${b.toString('hex')}`

function statement(text: string, values: string[]): Buffer {
  return Buffer.concat([serialize.parse({ text }), serialize.bind({ values }), EXECUTE])
}

/**
 * The messages that set `claims` (JSON text) on the backend behind `upstream`: edgepg.init first if
 * it has no key yet. One Sync group; the unnamed statement
 * is closed after, as a fresh session finds none.
 */
export function claimsMessages(upstream: Upstream, claims: string): Buffer {
  let k = keyed.get(upstream)
  const parts: Buffer[] = []
  if (!k) {
    keyed.set(upstream, (k = { key: randomBytes(32), n: 0 }))
    parts.push(statement(INIT, [hex(k.key)]))
  }
  const n = String(++k.n)
  const mac = createHmac('sha256', k.key).update(`${n}:${claims}`).digest()
  parts.push(statement(SET, [n, claims, hex(mac)]), serialize.close({ type: 'S', name: '' }), SYNC)
  return Buffer.concat(parts)
}

/** Sends the proxy's own messages and resolves with Postgres's error, if it gave one (rejects if the connection broke). */
export type Send = (bytes: Buffer) => Promise<{ code: string; message: string } | undefined>

const exchanged = (upstream: Upstream): Send => async (bytes) => {
  const answer = await exchange(upstream, bytes)
  if (!answer) throw new ClaimsError("edgepg-proxy: the connection to Postgres closed while the session's claims were set", '08006')
  return answer.error
}

/** Sets `claims` on an idle backend (by `send`: an exchange of its own by default) and waits for Postgres to confirm; ClaimsError says why not. */
export async function setClaims(upstream: Upstream, claims: string, send: Send = exchanged(upstream)): Promise<void> {
  const error = await send(claimsMessages(upstream, claims)).catch((err) => {
    keyed.delete(upstream)
    throw err
  })
  if (!error) return
  keyed.delete(upstream) // (it serves no one now: the caller closes it)
  const missing = (error.code === '42883' || error.code === '3F000') && error.message.includes('edgepg')
  throw new ClaimsError(
    missing
      ? `edgepg-proxy: the database has no edgepg functions for tokens: run edgepg-proxy setup-auth <database-url> (Postgres said: ${error.message})`
      : `edgepg-proxy: the session's claims could not be set: ${error.message}`,
    missing ? '28000' : error.code
  )
}

/**
 * The database's replica key (edgepg.replica_key), asked on `upstream`, a primary's backend the proxy
 * set claims on: its own key says the proxy asks. Undefined if Postgres refused (a database set up
 * before replicas took claims: setup-auth again) or the connection closed.
 */
export async function replicaKey(upstream: Upstream, ask: Ask = asked(upstream)): Promise<Buffer | undefined> {
  const k = keyed.get(upstream)
  if (!k) return undefined
  const n = ++k.n
  const mac = createHmac('sha256', k.key).update(`${n}:replica-key`).digest()
  const answer = await ask(Buffer.concat([statement(REPLICA_KEY, [String(n), hex(mac)]), serialize.close({ type: 'S', name: '' }), SYNC]))
  if (answer?.error) k.n-- // (its transaction rolled back: n was not used)
  return answer?.first && /^([0-9a-f]{2}){32,}$/.test(answer.first) ? Buffer.from(answer.first, 'hex') : undefined
}

/** Sends the proxy's own messages and resolves with Postgres's error, if it gave one, and the first row's first value (undefined: the connection closed). */
export type Ask = (bytes: Buffer) => Promise<{ error?: { code: string; message: string }; first?: string } | undefined>
const asked = (upstream: Upstream): Ask => (bytes) => exchange(upstream, bytes)

/**
 * The messages that set `claims` on a standby's backend, vouched for by a ticket under the replica
 * key (edgepg.set_replica_claims), with no Sync: they lead the lend's first group. In a block of their
 * own (a SELECT left in the implicit transaction of extended messages stays open through a simple
 * Query that follows, as the replica's check). The ticket travels as a bind parameter, as the MACs
 * do: no statement text shows it.
 */
export function replicaClaimsMessages(claims: string, key: Buffer): Buffer {
  const ticket = createHmac('sha256', key).update(`replica:${claims}`).digest()
  return Buffer.concat([BEGIN, statement(SET_ON_REPLICA, [claims, hex(ticket)]), COMMIT])
}
/** What replicaClaimsMessages answers with: a CommandComplete for each of its three statements. */
export const REPLICA_CLAIMS_ENDS = 3
const BEGIN = statement('BEGIN', [])
const COMMIT = statement('COMMIT', [])

/** A database's replica key as the proxy learns it: asked once (by the first session to need it, on its own backend), and again a minute after a refusal. */
export class ReplicaKeyCache {
  key?: Buffer
  private asking = false
  private refusedAt = -Infinity

  /** Asks it on `upstream` (see replicaKey) unless it is known, being asked, or was refused within the minute. */
  async learn(upstream: Upstream, ask?: Ask): Promise<void> {
    if (this.key || this.asking || performance.now() - this.refusedAt < REASK_MS) return
    this.asking = true
    try {
      this.key = await replicaKey(upstream, ask)
      if (!this.key) this.refusedAt = performance.now()
    } catch {
      // (The connection broke: the next to need it asks.)
    } finally {
      this.asking = false
    }
  }
}
const REASK_MS = 60_000
