/**
 * --workers: a key's backends move to the worker whose sessions wait for one (the messages:
 * proxy/cluster/worker.ts). A worker asks the others once the first session in its line has waited
 * ASK_AFTER_MS with none to be had there (most waits end sooner, on one given back there), and again
 * every ASK_AGAIN_MS while sessions wait (the others may have had none to spare, nor a lender yet).
 * Another worker's ask stands ASK_STANDS_MS: a backend that comes free meanwhile goes to it.
 */
import type { Backend } from './backends'

const ASK_AFTER_MS = 5
const ASK_AGAIN_MS = 100
const ASK_STANDS_MS = 250

/** How a key's backends travel between workers. */
export interface Moves {
  /** Asks the other workers for one of the key's backends. */
  want(): void
  /** Hands a backend this worker has no use for to worker `to`. */
  give(backend: Backend, to: number): void
}

/** One key's asks: this worker's, while its sessions wait, and those of the others that stand. */
export class Asks {
  /** The other workers' asks, in the order they asked, each with when it last did (performance.now()). */
  private readonly others = new Map<number, number>()
  private timer?: NodeJS.Timeout

  constructor(
    private readonly moves: Moves,
    /** Whether sessions wait here. */
    private readonly waiting: () => boolean,
    /** Whether they do, and no backend can be had here. */
    private readonly short: () => boolean
  ) {}

  /** A session joined the line. */
  lined() {
    this.timer ??= setTimeout(this.ask, ASK_AFTER_MS)
  }

  /** Asks at once, if still short (one just came, and sessions still wait). */
  again() {
    if (this.short()) this.moves.want()
  }

  private readonly ask = () => {
    this.timer = undefined
    if (!this.waiting()) return
    this.again()
    this.timer = setTimeout(this.ask, ASK_AGAIN_MS)
  }

  /** Worker `from` asked. */
  heard(from: number) {
    this.others.set(from, performance.now())
  }

  /** The worker that asked first, of those whose ask stands. */
  first(): number | undefined {
    if (!this.others.size) return undefined
    const now = performance.now()
    for (const [worker, at] of this.others) {
      if (now - at < ASK_STANDS_MS) return worker
      this.others.delete(worker)
    }
    return undefined
  }

  /** `backend` goes to worker `to`, which asked. */
  give(backend: Backend, to: number) {
    this.others.delete(to)
    this.moves.give(backend, to)
  }
}
