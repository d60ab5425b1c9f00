/**
 * Places under a limit, by key (a client address, or '' for a total): what the session, login,
 * cancel and /sql request limits count. They bound the whole proxy whatever --workers n.
 *
 * One process counts them itself (LocalPlaces). Among n workers, each may fill its share of every
 * key's limit without asking (the shares add up to the limit), so a key costs no IPC until one
 * worker holds all of its share. Past it, the worker asks the primary (PlacesKeeper), which grants
 * what no worker holds; when nothing is free it first has the others hand back what they hold and
 * do not use, so a place is refused only when the whole proxy has none. A worker that no longer
 * uses a key's places hands them back; once all have, every worker has its share again.
 */

export interface Places {
  /** A place for `key`: true, false when the limit is reached, or a promise of either (the primary's answer). */
  take(key: string): boolean | Promise<boolean>
  /** Gives back a place taken. */
  give(key: string): void
}

export class LocalPlaces implements Places {
  private readonly held = new Map<string, number>()

  constructor(readonly limit: number) {}

  take(key: string): boolean {
    const n = this.held.get(key) ?? 0
    if (n >= this.limit) return false
    this.held.set(key, n + 1)
    return true
  }

  give(key: string) {
    const n = this.held.get(key)! - 1
    n ? this.held.set(key, n) : this.held.delete(key)
  }
}

/** Where a module gets the places of a named limit: this process's own (`localPlaces`), or the whole proxy's. */
export type PlacesOf = (name: string, limit: number) => Places

export const localPlaces: PlacesOf = (_name, limit) => new LocalPlaces(limit)

/** Places to take together: each limit with its key. */
export type Wanted = readonly (readonly [Places, string])[]

/**
 * Takes a place in each, in order: -1, or the index of the first that had none (those taken before
 * it are given back). A promise where a worker asks its primary.
 */
export function takeAll(wanted: Wanted, from = 0): number | Promise<number> {
  for (let i = from; i < wanted.length; i++) {
    const [places, key] = wanted[i]
    const got = places.take(key)
    if (got === false) return giveAll(wanted.slice(0, i)), i
    if (got !== true) return got.then((ok) => (ok ? takeAll(wanted, i + 1) : (giveAll(wanted.slice(0, i)), i)))
  }
  return -1
}

export const giveAll = (wanted: Wanted) => {
  for (const [places, key] of wanted) places.give(key)
}

/** Worker `index`'s share of `limit` among `n`: the shares add up to the limit (some may be 0). */
export const shareOf = (limit: number, n: number, index: number) => (Number.isFinite(limit) ? Math.floor(limit / n) + (index < limit % n ? 1 : 0) : limit)

export type PlacesToPrimary =
  | { edgepg: 'places'; op: 'hello' }
  /** One more place for `key` under `limit`, please (this worker holds all it may). */
  | { edgepg: 'places'; op: 'want'; name: string; key: string; limit: number }
  /** The answer to `reclaim`: this worker holds `used` of `key` now, and no more. */
  | { edgepg: 'places'; op: 'handed'; name: string; key: string; used: number }
  /** This worker holds none of `key`. */
  | { edgepg: 'places'; op: 'release'; name: string; key: string }

export type PlacesToWorker =
  /** The answer to `hello`: keys whose shares this worker (a replacement) does not have, with what it may hold. */
  | { edgepg: 'places'; op: 'known'; leases: [name: string, key: string, lease: number][] }
  /** The answer to a `want`, in order. */
  | { edgepg: 'places'; op: 'grant'; name: string; key: string; ok: boolean }
  /** Hand back what you hold of `key` and do not use. */
  | { edgepg: 'places'; op: 'reclaim'; name: string; key: string }
  /** `key` has its shares again. */
  | { edgepg: 'places'; op: 'shares'; name: string; key: string }

interface Holding {
  used: number
  /** What this worker may hold without asking. */
  lease: number
  /** The primary keeps this key's count (the lease is not the share). */
  known: boolean
  /** Takes waiting for the primary's answer, in order. */
  waiting: ((ok: boolean) => void)[]
}

/** A worker's side of one limit. */
export class SharedPlaces implements Places {
  private readonly holdings = new Map<string, Holding>()

  private readonly share: number

  constructor(readonly name: string, readonly limit: number, workers: number, index: number, private readonly send: (m: PlacesToPrimary) => void) {
    this.share = shareOf(limit, workers, index)
  }

  take(key: string): boolean | Promise<boolean> {
    const h = this.holding(key)
    if (h.used < h.lease) return h.used++, true
    this.send({ edgepg: 'places', op: 'want', name: this.name, key, limit: this.limit })
    return new Promise((resolve) => h.waiting.push(resolve))
  }

  give(key: string) {
    const h = this.holdings.get(key)!
    h.used--
    this.settle(key, h)
  }

  hear(m: Exclude<PlacesToWorker, { op: 'known' }>) {
    const h = this.holding(m.key)
    if (m.op === 'grant') {
      if (m.ok) h.lease++, h.used++, (h.known = true)
      h.waiting.shift()!(m.ok)
    } else if (m.op === 'reclaim') {
      this.send({ edgepg: 'places', op: 'handed', name: this.name, key: m.key, used: h.used })
      h.lease = h.used
      h.known = true
    } else {
      h.lease = this.share
      h.known = false
    }
    this.settle(m.key, h)
  }

  /** A replacement worker starts with what the primary says. */
  lease(key: string, lease: number) {
    Object.assign(this.holding(key), { lease, known: true })
  }

  private holding(key: string): Holding {
    let h = this.holdings.get(key)
    if (!h) this.holdings.set(key, (h = { used: 0, lease: this.share, known: false, waiting: [] }))
    return h
  }

  /** Nothing held: forget a key at its share; hand back a lease the primary granted. */
  private settle(key: string, h: Holding) {
    if (h.used || h.waiting.length) return
    if (!h.known) this.holdings.delete(key)
    else if (h.lease) {
      h.lease = 0
      this.send({ edgepg: 'places', op: 'release', name: this.name, key })
    }
  }
}

interface Tally {
  limit: number
  /** What each worker may hold, where it is not its share. */
  leases: Map<number, number>
  /** Workers whose `handed` is awaited. */
  reclaiming: Set<number>
  /** Workers whose wants wait, in order (the head's reclaim round done or not). */
  wants: number[]
  reclaimed: boolean
}

/** The primary's side: every limit's counts, for the keys some worker holds past its share. */
export class PlacesKeeper {
  private readonly tallies = new Map<string, Map<string, Tally>>()
  /** Workers that said hello (a replacement hears nothing before). */
  private readonly ready = new Set<number>()

  constructor(private readonly workers: number, private readonly send: (worker: number, m: PlacesToWorker) => void) {}

  hear(worker: number, m: PlacesToPrimary) {
    if (m.op === 'hello') {
      this.ready.add(worker)
      const leases: [string, string, number][] = []
      for (const [name, tallies] of this.tallies) for (const [key, t] of tallies) if (t.leases.has(worker)) leases.push([name, key, t.leases.get(worker)!])
      return this.send(worker, { edgepg: 'places', op: 'known', leases })
    }
    const t = this.tally(m.name, m.key)
    if (m.op === 'want') t.wants.push(worker), (t.limit = m.limit)
    else if (m.op === 'handed') t.leases.set(worker, m.used), t.reclaiming.delete(worker)
    else t.leases.set(worker, 0)
    this.serve(m.name, m.key, t)
  }

  /** A worker died: it holds nothing (its replacement starts with nothing of the keys counted here). */
  gone(worker: number) {
    this.ready.delete(worker)
    for (const [name, tallies] of this.tallies) {
      for (const [key, t] of tallies) {
        if (t.wants[0] === worker) t.reclaimed = false // (the round was the dead worker's)
        t.leases.set(worker, 0)
        t.reclaiming.delete(worker)
        t.wants = t.wants.filter((w) => w !== worker)
        this.serve(name, key, t)
      }
    }
  }

  private tally(name: string, key: string): Tally {
    let tallies = this.tallies.get(name)
    if (!tallies) this.tallies.set(name, (tallies = new Map()))
    let t = tallies.get(key)
    if (!t) tallies.set(key, (t = { limit: Infinity, leases: new Map(), reclaiming: new Set(), wants: [], reclaimed: false }))
    return t
  }

  private leaseOf(t: Tally, worker: number) {
    return t.leases.get(worker) ?? shareOf(t.limit, this.workers, worker)
  }

  private serve(name: string, key: string, t: Tally) {
    while (t.wants.length && !t.reclaiming.size) {
      const worker = t.wants[0]
      let held = 0
      for (let w = 0; w < this.workers; w++) held += this.leaseOf(t, w)
      if (held < t.limit) {
        t.leases.set(worker, this.leaseOf(t, worker) + 1)
      } else if (!t.reclaimed) {
        t.reclaimed = true
        for (let w = 0; w < this.workers; w++) {
          if (w !== worker && this.ready.has(w) && this.leaseOf(t, w) > 0) t.reclaiming.add(w), this.send(w, { edgepg: 'places', op: 'reclaim', name, key })
        }
        continue
      }
      t.wants.shift()
      t.reclaimed = false
      this.send(worker, { edgepg: 'places', op: 'grant', name, key, ok: held < t.limit })
    }
    // Nobody holds anything of it: every worker has its share again.
    if (t.wants.length || t.reclaiming.size || [...t.leases.values()].some((n) => n > 0)) return
    this.tallies.get(name)!.delete(key)
    for (const w of t.leases.keys()) if (this.ready.has(w)) this.send(w, { edgepg: 'places', op: 'shares', name, key })
  }
}
